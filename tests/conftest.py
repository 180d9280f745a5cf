"""Shared fixtures: the real Megatron-LM fixtures dir and a session-wide gloo pool of megatron-core workers."""

from __future__ import annotations

import os
import shutil

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "megatron-lm")


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


@pytest.fixture(scope="module")
def training_pool2():
    """A 2-process world of its own for a module that trains (megatron-core's DDP, optimizer, a backward pass): the
    gloo threads of the process groups that training leaves alive in C++ (no Python object holds them; ~100 per
    MoE test) end with these processes instead of piling up in the session's pool."""
    yield from _pool(2)


@pytest.fixture(scope="session")
def mcore_pool2():
    """A 2-process world: fewer processes than cores, so gloo collectives in torch_dist saves/loads do not starve."""
    yield from _pool(2)
