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


@pytest.fixture(scope="session")
def mcore_pool():
    pytest.importorskip("megatron.core")
    from tests.helpers.pool import Pool

    pool = Pool(world=4)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def mcore_pool2():
    """A 2-process world: fewer processes than cores, so gloo collectives in torch_dist saves/loads do not starve."""
    pytest.importorskip("megatron.core")
    from tests.helpers.pool import Pool

    pool = Pool(world=2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ckpt_cache(tmp_path_factory):
    """Session cache of checkpoints written by real megatron-core models: key -> root dir."""
    return {"_dir": str(tmp_path_factory.mktemp("mcore_ckpts"))}
