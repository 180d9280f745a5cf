"""Shared fixtures: the real Megatron-LM fixtures dir and a session-wide gloo pool of megatron-core workers."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "megatron-lm")

# the index of a .metadata once read (megatron_preflight/layout/dcp_cache.py): the suite's own, not the user's cache
if "MEGATRON_PREFLIGHT_CACHE" not in os.environ:
    _INDEX = tempfile.mkdtemp(prefix="preflight-test-index-")
    atexit.register(shutil.rmtree, _INDEX, True)
    os.environ["MEGATRON_PREFLIGHT_CACHE"] = _INDEX


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES, name)


@pytest.fixture
def real_fixture(tmp_path):
    """Copy a real Megatron-LM fixture into tmp (for tests that damage it)."""

    def make(name: str) -> str:
        dst = tmp_path / name
        shutil.copytree(fixture_path(name), dst)
        return str(dst)

    return make


def _pool(world: int):
    pytest.importorskip("megatron.core")
    from tests.helpers.pool import Pool

    pool = Pool(world=world)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def mcore_pool():
    """A 4-process world (TP4 layouts need it)."""
    yield from _pool(4)


# A pool worker is replaced before a test once it holds more threads than this (a test adds up to ~100): each process
# of the suite stays under 256 threads.
TRAINING_THREAD_BUDGET = 120


@pytest.fixture(scope="module")
def _training_pools():
    held: dict = {}
    yield held
    if held.get("pool") is not None:
        held["pool"].close()


@pytest.fixture
def training_pool2(_training_pools):
    """A 2-process world of its own for the tests that train (megatron-core's DDP, optimizer, a backward pass): the
    gloo threads of the process groups that training leaves alive in C++ (no Python object holds them; ~100 per
    MoE test) end with these processes, replaced by fresh ones once they hold TRAINING_THREAD_BUDGET threads (kept
    for a module, three MoE tests took a worker to 306)."""
    return training_pool(_training_pools)


def training_pool(held: dict):
    """The module's training pool in ``held`` (module-scoped fixtures ask here too), replaced when it is full."""
    pytest.importorskip("megatron.core")
    from tests.helpers.pool import Pool, thread_counts

    pool = held.get("pool")
    if pool is not None and max(thread_counts(pool.pids).values()) > TRAINING_THREAD_BUDGET:
        pool.close()
        pool = None
    if pool is None:
        pool = held["pool"] = Pool(world=2)
    return pool


@pytest.fixture(scope="session")
def mcore_pool2():
    """A 2-process world: fewer processes than cores, so gloo collectives in torch_dist saves/loads do not starve."""
    yield from _pool(2)


@pytest.fixture
def s3(monkeypatch):
    """A real S3-compatible server (SeaweedFS: tests/helpers/s3_server.py), MSC_CONFIG naming its profile ``store``
    (skipped where the client or the server is not installed)."""
    from tests.helpers import s3_server

    server = s3_server.for_tests()
    monkeypatch.setenv("MSC_CONFIG", server.config())
    return server
