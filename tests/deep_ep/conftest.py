"""The EP8 gloo CPU ranks the ported DeepEP tests share (started once for the deep_ep tests)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ranks8():
    from moe_sbo.launch.ranks import LocalRanks

    with LocalRanks(8, device="cpu") as ranks:
        yield ranks
