"""Shared fixtures: persistent gloo rank pools (one start-up per world size) and the gpu marker."""

from __future__ import annotations

import pytest
import torch

from moe_sbo.runtime import LocalRanks


@pytest.fixture(scope="session")
def ranks2():
    with LocalRanks(2, device="cpu") as ranks:
        yield ranks


@pytest.fixture(scope="session")
def ranks4():
    with LocalRanks(4, device="cpu") as ranks:
        yield ranks


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
