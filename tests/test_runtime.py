"""Launching ranks: failures surface with the failing rank's traceback; torchrun jobs work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from moe_sbo.runtime import LocalRanks, RankError, resolve_device


def _fail_on_rank_1(device):
    if dist.get_rank() == 1:
        raise KeyError("planted failure")
    return dist.get_rank()


def _rank(device):
    return dist.get_rank()


def test_a_failing_rank_is_named_with_its_traceback(ranks2):
    with pytest.raises(RankError, match=r"failed on ranks \[1\](.|\n)*planted failure"):
        ranks2.run(_fail_on_rank_1)
    assert ranks2.run(_rank) == [0, 1]  # the pool survives a failed call


def test_bad_launch_arguments():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        LocalRanks(0)
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        resolve_device("tpu")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_torchrun_job(dispatcher):
    worker = Path(__file__).with_name("torchrun_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(worker), dispatcher], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0/2" in proc.stdout and "rank 1/2" in proc.stdout
