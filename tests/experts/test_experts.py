"""The dense routes (``torch._grouped_mm``, ``gemv``'s Triton kernel for few rows per expert,
``tiled_gemm``'s tiled one for more, and the per-expert loop) against a per-token reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from moe_sbo.experts.conditions import GEMV_MAX_ROWS_PER_EXPERT, TILED_MAX_ROWS_PER_EXPERT, Conditions
from moe_sbo.experts.routed import RoutedExperts
from moe_sbo.experts.routes import GROUPED_MM
from moe_sbo.experts.shared import SharedExperts
from moe_sbo.experts.tiled_gemm import TMA_MIN_ROWS_PER_EXPERT, dense_config, grouped_gemm
from moe_sbo.experts.tiles import GemmConfig


def _reference(x_RH, counts, gate_up, down):
    out, start = [], 0
    for expert, n in enumerate(counts):
        for row in x_RH[start : start + n]:
            gate, up = (gate_up[expert] @ row).chunk(2)
            out.append(down[expert] @ (F.silu(gate) * up))
        start += n
    return torch.stack(out) if out else x_RH.new_zeros(0, down.shape[1])


@pytest.mark.parametrize("kernels", ["grouped_mm", "expert_loop"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [9, 0, 0, 0], [0, 0, 0, 2]])
def test_routed_experts_match_per_token_reference(kernels, counts):
    experts = RoutedExperts(4, 32, 16)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
        experts.kernels = kernels
        x = torch.randn(sum(counts), 32)
        got = experts(x, torch.tensor(counts))
        expected = _reference(x, counts, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [40, 0, 0, 2], [0, 17, 0, 16]])
def test_gemv_kernel_matches_per_token_reference_and_skips_padding(counts):
    # Sizes off the kernel's blocks (H 40, I 24: N 48 and 40, K 40 and 24), an expert with more
    # rows than one tl.dot block (40 > 16), empty experts, and padding rows after the last offset,
    # which the kernel must leave as they are (NaN here).
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    torch.manual_seed(sum(counts))
    experts = RoutedExperts(4, 40, 24, device=device)
    experts.kernels = "gemv"
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
        real = sum(counts)
        x = torch.cat([torch.randn(real, 40, device=device), torch.full((5, 40), float("nan"), device=device)])
        got = experts(x, torch.tensor(counts))
        expected = _reference(x[:real], counts, experts.gate_up_proj, experts.down_proj)
    assert experts.route(x).name == "gemv"
    # Outputs reach ~100 with unit weights; another float32 summation order moves them by ~1e-4.
    torch.testing.assert_close(got[:real], expected, rtol=1e-4, atol=1e-3)


# Small tiles so that the sizes below span several row and column tiles, a partial K step, and an
# expert with more rows than one tile.
SMALL_TILES = GemmConfig(block_m=16, block_n=32, group_m=2, num_warps=4, num_stages=2, block_k=32)


def _tiled_reference(x_RK: torch.Tensor, w_LNK: torch.Tensor, counts: list[int]) -> torch.Tensor:
    device = x_RK.device
    expert_R = torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))
    return torch.einsum("rk,rnk->rn", x_RK, w_LNK[expert_R])


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [40, 0, 0, 2], [0, 17, 0, 33]])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("tma", [False, True])
def test_tiled_kernel_matches_reference_reads_through_index_and_skips_padding(counts, gather, tma):
    # N 48 and K 40: off the 32-wide tiles. Rows past the last offset are padding the kernel must not
    # read: NaN rows in x (they would reach no real row's output anyway), and, through the index,
    # entries pointing far past the buffer, which a read would fault on. With ``tma`` the weight tiles
    # (and the contiguous rows) come through descriptors, whose tiles run past experts and the tensor.
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    torch.manual_seed(len(counts) + sum(counts))
    real = sum(counts)
    w_LNK = torch.randn(4, 48, 40, device=device)
    offsets_L = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    x_RK = torch.randn(real, 40, device=device)
    if gather:  # the rows come out of a wider, strided buffer in another order, as a receive buffer holds them
        buffer = torch.full((real + 7, 56), float("nan"), device=device)
        rows_R = torch.randperm(real + 7, device=device)[:real]
        buffer[rows_R, :40] = x_RK
        past_the_buffer = torch.full((5,), 1 << 40, dtype=rows_R.dtype, device=device)
        got = grouped_gemm(
            buffer[:, :40],
            w_LNK,
            offsets_L,
            rows_R=torch.cat([rows_R, past_the_buffer]),
            config=dataclasses.replace(SMALL_TILES, tma=True) if tma else None,
        )
    else:
        padded = torch.cat([x_RK, torch.full((5, 40), float("nan"), device=device)])
        got = grouped_gemm(padded, w_LNK, offsets_L, config=dataclasses.replace(SMALL_TILES, tma=tma))
    torch.testing.assert_close(got[:real], _tiled_reference(x_RK, w_LNK, counts), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "config",
    [
        # The kernel's own tiles for float32: 64 x 128, then 128 x 256 (two row tiles for 130 rows),
        # with descriptor loads, and the same with per-thread loads.
        dense_config(1, element_size=4),
        dense_config(1000, element_size=4),
        dataclasses.replace(dense_config(1000, element_size=4), tma=False),
        GemmConfig(block_m=16, block_n=32, group_m=3, num_warps=4, num_stages=2, block_k=32),  # partial groups
        GemmConfig(block_m=16, block_n=32, group_m=3, num_warps=4, num_stages=2, block_k=32, tma=True),
    ],
)
def test_tiled_kernel_on_whole_k_steps_and_its_own_tiles(config):
    # K 128: a whole number of K steps (the unmasked loads every DeepSeek-V3 GEMM takes); N 256; an
    # expert with more rows than a 128-row tile; an int32 index that is a strided view.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(config.block_m)
    counts = [0, 130, 3, 70]
    real = sum(counts)
    w_LNK = torch.randn(4, 256, 128, device=device) * 128**-0.5
    offsets_L = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    x_RK = torch.randn(real, 128, device=device)
    torch.testing.assert_close(
        grouped_gemm(x_RK, w_LNK, offsets_L, config=config), _tiled_reference(x_RK, w_LNK, counts), rtol=1e-4, atol=1e-4
    )
    rows_R = torch.arange(real - 1, -1, -1, dtype=torch.int32, device=device).repeat_interleave(2)[::2]
    assert rows_R.stride() == (2,)  # real - 1 .. 0 as a strided view
    got = grouped_gemm(x_RK.flip(0), w_LNK, offsets_L, rows_R=rows_R, config=config)
    torch.testing.assert_close(got, _tiled_reference(x_RK, w_LNK, counts), rtol=1e-4, atol=1e-4)


def test_tiled_tiles_by_rows_per_expert():
    # 64 x 128 tiles up to 64 rows per expert, 128 x 256 above; descriptor loads only from
    # TMA_MIN_ROWS_PER_EXPERT (below they gained nothing on H200 and cost the host per launch).
    small, mid, large = (dense_config(rows) for rows in (64, 128, TMA_MIN_ROWS_PER_EXPERT))
    assert (small.block_m, small.block_n, small.tma) == (64, 128, False)
    assert (mid.block_m, mid.block_n, mid.tma) == (128, 256, False)
    assert (large.block_m, large.block_n, large.tma, large.num_stages) == (128, 256, True, 4)
    assert dense_config(TMA_MIN_ROWS_PER_EXPERT, element_size=4).num_stages == 2  # float32 fits shared memory


def test_tiled_kernel_refuses_mismatched_shapes():
    offsets = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="grouped_gemm needs x"):
        grouped_gemm(torch.randn(4, 8), torch.randn(2, 6, 10), offsets)
    with pytest.raises(ValueError, match="K contiguous"):
        grouped_gemm(torch.randn(8, 4).T, torch.randn(2, 6, 8), offsets)
    with pytest.raises(ValueError, match="one dtype"):
        grouped_gemm(torch.randn(4, 8), torch.randn(2, 6, 8, dtype=torch.float64), offsets)
    with pytest.raises(ValueError, match="integer"):
        grouped_gemm(torch.randn(4, 8), torch.randn(2, 6, 8), offsets, rows_R=torch.zeros(4))


def test_routed_experts_choose_their_route_by_rows():
    """``RoutedExperts.route`` on this machine's device (the rule table itself, on faked devices, is
    ``test_select.py``'s): the rows per expert to expect, the rows handed over, the index."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts = RoutedExperts(4, 40, 24, device=device)
    sizes = [4 * GEMV_MAX_ROWS_PER_EXPERT, 4 * GEMV_MAX_ROWS_PER_EXPERT + 1, 4 * TILED_MAX_ROWS_PER_EXPERT + 1]
    rows = [torch.empty(n, 40, device=device, dtype=torch.bfloat16) for n in sizes]
    grouped = GROUPED_MM.supports(Conditions.of(rows[0], False, 1)) is None
    torch_route = "grouped_mm" if grouped else "expert_loop"
    on_cuda = ["gemv", "tiled" if grouped else torch_route, torch_route]
    names = [experts.route(x).name for x in rows]
    assert names == (on_cuda if device == "cuda" else ["grouped_mm"] * 3)
    # "auto" runs the tiled GEMM only where its tiles were chosen (bf16, sm90+): float32 rows do not.
    assert experts.route(rows[1].float()).name == ("expert_loop" if device == "cuda" else "grouped_mm")
    # Rows read through an index: the tiled GEMM above the GEMV's sizes, which torch._grouped_mm
    # could run only on a copy; the row count is the index's, not the buffer's.
    indexed = [experts.route(rows[0], num_rows=n, indexed=True).name for n in sizes]
    assert indexed == (["gemv", on_cuda[1], on_cuda[1]] if device == "cuda" else ["grouped_mm"] * 3)
    experts.kernels = "triton"
    assert [experts.route(x).name for x in rows] == ["gemv", "tiled", "tiled"]
    # Padding after the real rows: the rule counts the rows to expect, never more than are there.
    assert experts.route(rows[2], expected_rows=sizes[0]).name == "gemv"
    assert experts.route(rows[0], expected_rows=10 * sizes[2]).name == "gemv"
    experts.kernels = "tiled"
    assert experts.route(rows[0]).name == "tiled"
    experts.kernels = "scaled_mm"
    with pytest.raises(ValueError, match="'scaled_mm' route for dense experts, which is for FP8 weights"):
        experts.route(rows[0])
    experts.kernels = "cuda"
    with pytest.raises(ValueError, match="kernels must be one of"):
        experts.route(rows[0])


def test_routed_experts_tiled_path_matches_per_token_reference():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts = RoutedExperts(4, 40, 24, device=device)
    experts.kernels = "tiled"
    counts = [9, 0, 30, 2]
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
        x = torch.randn(sum(counts), 40, device=device)
        got = experts(x, torch.tensor(counts))
        expected = _reference(x, counts, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)


def test_shared_experts_are_a_swiglu_mlp():
    shared = SharedExperts(32, 24)
    with torch.no_grad():
        shared.gate_up_proj.normal_()
        shared.down_proj.normal_()
        x = torch.randn(5, 32)
        gate, up = shared.gate_up_proj[:24], shared.gate_up_proj[24:]
        expected = (F.silu(x @ gate.T) * (x @ up.T)) @ shared.down_proj.T
        torch.testing.assert_close(shared(x), expected)


@pytest.mark.gpu
def test_grouped_mm_on_gpu_matches_fallback_in_bf16():
    experts = RoutedExperts(8, 256, 128, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=256**-0.5)
        experts.down_proj.normal_(std=128**-0.5)
        counts = torch.tensor([64, 0, 17, 128, 3, 0, 40, 1], device="cuda")
        x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
        experts.kernels = "gemv"
        gemv = experts(x, counts)
        experts.kernels = "tiled"
        tiled = experts(x, counts)
        experts.kernels = "torch"
        fast = experts(x, counts)
        experts.kernels = "expert_loop"
        slow = experts(x, counts)
    for got in (gemv, tiled, fast):
        rel = ((got.float() - slow.float()).norm() / slow.float().norm()).item()
        assert rel < 1e-2  # bf16 GEMMs with different tilings
