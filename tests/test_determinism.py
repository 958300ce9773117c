"""Same seed and inputs give bitwise-identical outputs run to run on CPU: every dispatcher x overlap
mode, one batch or two-batch overlap, float32 and bfloat16, low_latency with fp8 dispatch too.

"Run to run" is checked three ways: two forwards of one layer, a freshly built layer, and freshly
started rank processes (a second pool). Every reduction has a fixed order: the combines sum with
``reduce.gather_sum`` (a chain over k), gloo's reduce-scatter sums in a fixed ring order and each rank
uses one thread. (The GPU side, tested in tests/test_gpu.py, is in docs/RELIABILITY.md §6.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.dispatch import DISPATCHERS
from moe_sbo.launch.ranks import LocalRanks
from moe_sbo.layer import MoELayer
from moe_sbo.overlap import OVERLAP_MODES
from test_fuzz import forward  # one batch, or the two micro-batches of two-batch overlap

TOKENS = [9, 0, 16, 5]  # per rank: uneven, one rank empty
# (dispatcher, fp8 dispatch, hidden size): fp8 needs H to be a multiple of 128.
SCHEMES = [(name, False, 64) for name in sorted(DISPATCHERS)] + [("low_latency", True, 128)]
# Every overlap mode in one batch; two-batch overlap (which interleaves two forwards) with two of them.
CASES = [(mode, False) for mode in OVERLAP_MODES] + [("none", True), ("split", True)]


def _layer(name: str, fp8: bool, hidden: int, overlap: str, dtype: torch.dtype) -> MoELayer:
    options = {"max_tokens_per_rank": 16, "fp8": fp8} if name == "low_latency" else None
    return MoELayer(
        get_preset("tiny").replace(hidden_size=hidden),
        dispatcher=name,
        overlap=overlap,
        dtype=dtype,
        seed=21,
        dispatcher_options=options,
    )


def _outputs_rank(device, dtype_name):
    """Per (scheme, mode, tbo): the output, and whether two forwards and a fresh layer's agreed bitwise."""
    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    out = {}
    with torch.inference_mode():
        for name, fp8, hidden in SCHEMES:
            x_TH = torch.randn(TOKENS[rank], hidden, generator=torch.Generator().manual_seed(rank)).to(dtype)
            for mode, tbo in CASES:
                layer = _layer(name, fp8, hidden, mode, dtype)
                ys = [
                    forward(layer, x_TH, tbo),
                    forward(layer, x_TH, tbo),
                    forward(_layer(name, fp8, hidden, mode, dtype), x_TH, tbo),
                ]  # and a fresh layer
                out[(name, fp8, mode, tbo)] = (ys[0], all(torch.equal(y, ys[0]) for y in ys[1:]))
    return out


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_outputs_are_bitwise_identical_run_to_run_on_cpu(ranks4, dtype_name):
    first = ranks4.run(_outputs_rank, dtype_name)
    with LocalRanks(4) as fresh:  # new processes: nothing carried over from the first run
        second = fresh.run(_outputs_rank, dtype_name)
    for rank, (mine, again) in enumerate(zip(first, second)):
        assert mine.keys() == again.keys() and len(mine) == len(SCHEMES) * len(CASES)
        for key, (y, stable) in mine.items():
            assert stable, f"rank {rank} {key}: forwards or fresh layers differ within one run"
            assert y.shape == (TOKENS[rank], 128 if key[1] else 64)
            assert torch.equal(y, again[key][0]), f"rank {rank} {key}: a second run differs"
