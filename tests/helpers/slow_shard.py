"""A slow stand-in for the writer's per-shard work (test-only): the worker sleeps before writing its shard, so a test
can kill the main process while the workers are busy."""

from __future__ import annotations

import time

from megatron_preflight.reshard.targets import offline as writer


def write_shard(name, iter_out, verify, resharder=None):
    time.sleep(30)
    return writer._write_shard(name, iter_out, verify, resharder)
