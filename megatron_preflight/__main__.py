import sys

from megatron_preflight.cli.main import main

sys.exit(main())
