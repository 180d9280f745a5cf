import sys

from megatron_preflight.cli.main import entry

sys.exit(entry())
