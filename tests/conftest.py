"""Shared fixtures: persistent gloo rank pools (one start-up per world size) and the gpu marker.

Without CUDA, Triton kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET`` must be set before
``triton.jit`` decorates them (at import), and the gloo ranks, forked later, inherit it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The terminal width rich lays output out for, the same under pytest-xdist's workers, a pipe or a tty
# (a temporary path or a memory figure one character longer must not move a line break a test reads).
os.environ.setdefault("COLUMNS", "200")

from moe_sbo.launch.ranks import LocalRanks


@pytest.fixture(scope="session")
def ranks2():
    with LocalRanks(2, device="cpu") as ranks:
        yield ranks


@pytest.fixture(scope="session")
def ranks4():
    with LocalRanks(4, device="cpu") as ranks:
        yield ranks


@pytest.fixture(scope="module")
def gpu_pools():
    """``gpu_pools(world)``: CUDA ranks of that EP size, started at their first call and kept for the
    module (a start costs seconds: CUDA, the group); ranks share GPUs where there are fewer."""
    from moe_sbo.launch.ranks import RankPool

    started: dict[int, RankPool] = {}
    yield lambda world: started.setdefault(world, RankPool(world, "cuda"))
    for pool in started.values():
        pool.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU tests: pytest -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
