"""What every subcommand shares: exit codes, the JSON printer, the --all-shards flag."""

from __future__ import annotations

import argparse
import json

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def to_json_text(doc: dict, shards: int) -> str:
    """Indented for a person; compact (json's C encoder) for thousands of shards, where indenting takes seconds."""
    return json.dumps(doc, indent=1 if shards <= 256 else None)


def add_shards_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--all-shards", action="store_true",
                   help="parse every legacy shard file (default: all up to 32, above that rank 0's, the first of each "
                        "pipeline stage and the last, with every file sized and its zip trailer checked)")
