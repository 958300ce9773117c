"""SGLang 0.5.23's DeepEP dispatcher path with moe-sbo inside equals a single-rank reference, on gloo CPU
ranks: the dispatcher ``create_moe_dispatcher`` returns through the plugin's hook, its ``dispatch`` /
``combine`` (and the ``dispatch_a``/``b``, ``combine_a``/``b`` halves two-batch overlap calls), SGLang's
DeepEP output formats in between, plain float32 experts on them.

Both of the plugin's dispatchers: ``deep_ep`` (SGLang's own ``MaybeTboDeepEPDispatcher`` /
``DeepEPDispatcher`` on ``moe_sbo.deep_ep.Buffer``) and ``moe_sbo`` (moe-sbo's ``MoeSboTboDispatcher``);
both of SGLang's DeepEP modes: normal (moe-sbo's ``alltoall`` on one node, ``node_aware`` on 2 nodes of
2 ranks) and low-latency (``low_latency``); EP2 and EP4; float32 (≤ 1e-5 relative) and bf16
(≤ 2e-2). SGLang's runtime on each rank: ``sglang_runtime.py``.
"""

from __future__ import annotations

import pytest
import sglang_runtime
import torch
import torch.distributed as dist

sglang_runtime.cpu_torchvision()  # before anything imports sglang (which imports torchvision)
pytest.importorskip("sglang", reason="SGLang is installed by `make test-sglang` (.venv-sglang)")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HIDDEN, TOP_K, TOKENS = 128, 2, 12


def expert_weights(num_experts: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's copy of the experts (same seed): gate_up float32 [E, 2I, H], down [E, H, I]."""
    g = torch.Generator().manual_seed(1234)
    inter = 2 * hidden
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w_gate_up, w_down


def run_expert(x_NH: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, e: int) -> torch.Tensor:
    """Expert ``e`` on rows ``x_NH`` in float32."""
    gate, up = (x_NH.float() @ w_gate_up[e].T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w_down[e].T


def routing(rank: int, num_experts: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's tokens (x [T, H]), top-k ids (distinct per token, int32 as SGLang's top-k gives) and
    weights (float32), fresh per rank."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:TOP_K] for _ in range(TOKENS)]).int()
    weights = torch.rand(TOKENS, TOP_K, generator=g).softmax(dim=-1)
    return x, ids, weights


def reference(x, ids, weights, w_gate_up, w_down) -> torch.Tensor:
    """The single-rank MoE: y[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), float32."""
    y = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            y[t] += weights[t, k] * run_expert(x[t : t + 1], w_gate_up, w_down, int(ids[t, k]))[0]
    return y


def dequantized(x_TH: torch.Tensor) -> torch.Tensor:
    """``x`` as moe-sbo's fp8 wire carries it: e4m3 times one float32 scale per 128 values."""
    from moe_sbo.quant.fp8 import quantize_fp8

    q, scales = quantize_fp8(x_TH)
    return (q.float().view(*q.shape[:-1], -1, 128) * scales[..., None]).view(q.shape)


def experts_on(dispatch_output, w_gate_up, w_down, first_expert: int):
    """The local experts on SGLang's DeepEP dispatch output -> SGLang's combine input (in the dtype of
    the rows' source: bf16 for an fp8 wire)."""
    from sglang.srt.layers.moe.token_dispatcher import DeepEPLLCombineInput, DeepEPNormalCombineInput

    out = dispatch_output
    if out.hidden_states_scale is not None:  # fp8 rows and float32 scales [..., H / 128]
        rows = out.hidden_states.float() * out.hidden_states_scale.repeat_interleave(128, dim=-1)
        out = out._replace(hidden_states=rows.to(torch.bfloat16), hidden_states_scale=None)
    if out.format.is_deepep_normal():
        # One row per (token, this rank): the row's local choices, weighted and summed (DeepEP normal).
        y = torch.zeros(out.hidden_states.shape[0], out.hidden_states.shape[1])
        for k in range(out.topk_ids.shape[1]):
            for e in out.topk_ids[:, k].unique().tolist():
                if e < 0:
                    continue
                rows = (out.topk_ids[:, k] == e).nonzero().squeeze(1)
                y_rows = run_expert(out.hidden_states[rows], w_gate_up, w_down, first_expert + e)
                y[rows] += out.topk_weights[rows, k, None] * y_rows
        return DeepEPNormalCombineInput(y.to(out.hidden_states.dtype), out.topk_ids, out.topk_weights)
    # Low latency: [L, X, H], the first masked_m[l] rows of expert l are real; outputs unweighted.
    y = torch.zeros(out.hidden_states.shape, dtype=out.hidden_states.dtype)
    for e, n in enumerate(out.masked_m.tolist()):
        y[e, :n] = run_expert(out.hidden_states[e, :n], w_gate_up, w_down, first_expert + e).to(y.dtype)
    return DeepEPLLCombineInput(y, out.topk_ids, out.topk_weights)


def forward_rank(
    device, dispatcher: str, mode: str, dtype: torch.dtype, ranks_per_node, split: bool, wire: str = "bf16"
) -> dict:
    """One MoE forward through SGLang's dispatcher on this rank -> its relative error to the reference
    and what the dispatcher was. ``wire``: SGLang's ``--deepep-dispatcher-output-dtype``; with fp8 the
    reference runs on x as the fp8 wire carries it (moe-sbo's ``quantize_fp8``, dequantised)."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.runtime_context import get_exec

    sglang_runtime.ensure(mode)
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = 4 * world
    w_gate_up, w_down = expert_weights(num_experts, HIDDEN)
    x, ids, weights = routing(rank, num_experts, dtype)
    with (
        sglang_runtime.plugin_choice(dispatcher, None, ranks_per_node),
        sglang_runtime.sglang_deep_gemm_path(),
        get_exec().moe.override(deepep_dispatcher_output_dtype=wire),
    ):
        d = sglang_runtime.create_dispatcher(num_experts, HIDDEN, TOP_K, dtype)
        schemes = schemes_seen(num_experts)
        topk = StandardTopKOutput(weights, ids, torch.zeros(TOKENS, num_experts))
        if split:  # the halves two-batch overlap calls
            d.dispatch_a(hidden_states=x, topk_output=topk)
            out = d.dispatch_b()
            d.combine_a(combine_input=experts_on(out, w_gate_up, w_down, rank * (num_experts // world)))
            y = d.combine_b()
        else:
            out = d.dispatch(hidden_states=x, topk_output=topk)
            y = d.combine(combine_input=experts_on(out, w_gate_up, w_down, rank * (num_experts // world)))
        inner = d._inners[0]
        in_forward = getattr(inner, "forward_in_progress", False)  # moe-sbo's; SGLang's has none
    ref = reference(dequantized(x) if wire == "fp8" else x, ids, weights, w_gate_up, w_down)
    error = ((y.float() - ref).norm() / ref.norm()).item()
    return {
        "error": error,
        "dtype": y.dtype,
        "shape": tuple(y.shape),
        "class": type(d).__name__,
        "inner": type(inner).__name__,
        "format": out.format.value,
        "schemes": sorted(schemes),
        "forward_left": in_forward,
    }


def schemes_seen(num_experts: int) -> set[str]:
    """The names of the moe-sbo dispatchers the process buffer runs from now on (what DeepEP's modes
    map to), through the buffer's hooks. The buffer is SGLang's ``DeepEPBuffer.get_deepep_buffer``'s:
    the plugin's, made here first, then found by the dispatcher."""
    from sglang.srt.layers.moe import get_deepep_mode
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPBuffer
    from sglang.srt.runtime_context import get_parallel

    import moe_sbo.deep_ep

    group = get_parallel().tp_group.device_group
    buffer = DeepEPBuffer.get_deepep_buffer(group, HIDDEN, 2, get_deepep_mode(), 128, num_experts)
    assert isinstance(buffer, moe_sbo.deep_ep.Buffer), type(buffer)
    seen: set[str] = set()
    buffer.hooks.register("pre_dispatch", lambda dispatcher, payload: seen.add(dispatcher.name))
    return seen


CASES = [
    # (dispatcher, deepep mode, ranks per node, expected moe-sbo scheme, SGLang output format)
    ("deep_ep", "normal", None, "alltoall", "deepep_normal"),
    ("deep_ep", "low_latency", None, "low_latency", "deepep_ll"),
    ("moe_sbo", "normal", None, "alltoall", "deepep_normal"),
    ("moe_sbo", "low_latency", None, "low_latency", "deepep_ll"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c[:2]) for c in CASES])
def test_sglang_dispatcher_equals_reference(case, world, dtype, request):
    dispatcher, mode, ranks_per_node, scheme, fmt = case
    ranks = request.getfixturevalue(f"ranks{world}")
    for r in ranks.run(forward_rank, dispatcher, mode, dtype, ranks_per_node, world == 4):
        assert r["error"] <= TOLERANCE[dtype], r
        assert (r["dtype"], r["shape"]) == (dtype, (TOKENS, HIDDEN))
        assert r["format"] == fmt and r["schemes"] == [scheme]
        expected = ("MaybeTboDeepEPDispatcher", "DeepEPDispatcher")
        if dispatcher == "moe_sbo":
            expected = ("MoeSboTboDispatcher", "MoeSboDispatcher")
        assert (r["class"], r["inner"]) == expected
        assert not r["forward_left"]


@pytest.mark.parametrize("dispatcher", ["deep_ep", "moe_sbo"])
def test_low_latency_fp8_wire(dispatcher, ranks2):
    """``--deepep-dispatcher-output-dtype fp8`` in low-latency mode: e4m3 rows and float32 scales."""
    for split in (False, True):
        for r in ranks2.run(forward_rank, dispatcher, "low_latency", torch.bfloat16, None, split, "fp8"):
            assert r["error"] <= TOLERANCE[torch.bfloat16], r


def refused_rank(device, wire: str, mode: str) -> str:
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.runtime_context import get_exec

    sglang_runtime.ensure(mode)
    x, ids, weights = routing(dist.get_rank(), 8, torch.bfloat16)
    with (
        sglang_runtime.plugin_choice("moe_sbo", None, None),
        get_exec().moe.override(deepep_dispatcher_output_dtype=wire),
    ):
        d = sglang_runtime.create_dispatcher(8 * dist.get_world_size() // 2, HIDDEN, TOP_K, torch.bfloat16)
        try:
            d.dispatch(hidden_states=x, topk_output=StandardTopKOutput(weights, ids, torch.zeros(TOKENS, 8)))
        except ValueError as err:
            assert not d._inners[0].forward_in_progress, "a refused forward leaves nothing behind"
            return str(err)
    return "accepted"


def test_refusals_name_the_flag(ranks2):
    """What moe-sbo's dispatcher cannot send is refused on every rank before any transfer."""
    for message in ranks2.run(refused_rank, "fp8", "normal"):
        assert "fp8 in low-latency mode only" in message and "--deepep-dispatcher-output-dtype bf16" in message
    for message in ranks2.run(refused_rank, "nvfp4", "low_latency"):
        assert "sends bf16 or fp8" in message and "nvfp4" in message


@pytest.mark.parametrize("dispatcher", ["deep_ep", "moe_sbo"])
def test_node_aware_two_nodes_of_two(dispatcher, ranks4):
    """``MOE_SBO_RANKS_PER_NODE=2`` on 4 ranks: the normal mode runs moe-sbo's ``node_aware``."""
    for dtype in (torch.float32, torch.bfloat16):
        for r in ranks4.run(forward_rank, dispatcher, "normal", dtype, 2, False):
            assert r["error"] <= TOLERANCE[dtype], r
            assert r["schemes"] == ["node_aware"]


def two_batch_rank(device, dispatcher: str, mode: str) -> dict:
    """SGLang's two-batch overlap order on one layer: micro-batches 0 and 1 interleaved through
    ``dispatch_a``/``dispatch_b``/``combine_a``/``combine_b`` with ``tbo_subbatch_index``, both in
    flight at once on the process buffer -> each micro-batch's error to the reference."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.runtime_context import get_flags

    sglang_runtime.ensure(mode)
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = 4 * world
    w_gate_up, w_down = expert_weights(num_experts, HIDDEN)
    x, ids, weights = routing(rank, num_experts, torch.float32)
    halves = [slice(0, TOKENS // 2), slice(TOKENS // 2, TOKENS)]
    first = rank * (num_experts // world)
    with (
        sglang_runtime.plugin_choice(dispatcher, None, None),
        sglang_runtime.sglang_deep_gemm_path(),
        get_flags().moe.override(tbo_enabled=True),
    ):
        d = sglang_runtime.create_dispatcher(num_experts, HIDDEN, TOP_K, torch.float32)
        for i, part in enumerate(halves):
            topk = StandardTopKOutput(weights[part], ids[part], torch.zeros(TOKENS // 2, num_experts))
            d.dispatch_a(hidden_states=x[part], topk_output=topk, tbo_subbatch_index=i)
        outs = [d.dispatch_b(tbo_subbatch_index=i) for i in range(2)]
        for i, out in enumerate(outs):
            d.combine_a(combine_input=experts_on(out, w_gate_up, w_down, first), tbo_subbatch_index=i)
        ys = [d.combine_b(tbo_subbatch_index=i) for i in range(2)]
    errors = []
    for part, y in zip(halves, ys):
        ref = reference(x[part], ids[part], weights[part], w_gate_up, w_down)
        errors.append(((y - ref).norm() / ref.norm()).item())
    return {"errors": errors, "inners": [type(inner).__name__ for inner in d._inners]}


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("dispatcher", ["deep_ep", "moe_sbo"])
def test_two_batch_overlap_order(dispatcher, mode, ranks2):
    for r in ranks2.run(two_batch_rank, dispatcher, mode):
        assert max(r["errors"]) <= TOLERANCE[torch.float32], r
        assert len(r["inners"]) == 2


def auto_mode_rank(device, dispatcher: str) -> list[dict]:
    """``--deepep-mode auto`` as a server runs it: an extend batch (normal mode), then decode batches
    (low-latency; with ``deep_ep``, SGLang's ``DeepEPBuffer`` cleans the buffer's low-latency state on
    the switch), then an extend batch again, on one dispatcher -> each forward's format and error."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.runtime_context import get_forward

    sglang_runtime.ensure("auto")
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = 4 * world
    w_gate_up, w_down = expert_weights(num_experts, HIDDEN)
    first = rank * (num_experts // world)
    results = []
    with sglang_runtime.plugin_choice(dispatcher, None, None), sglang_runtime.sglang_deep_gemm_path():
        d = sglang_runtime.create_dispatcher(num_experts, HIDDEN, TOP_K, torch.float32)
        for step, extend in enumerate((True, False, False, True)):
            x, ids, weights = routing(rank + 10 * step, num_experts, torch.float32)
            with get_forward().scoped(is_extend_in_batch=extend):
                out = d.dispatch(hidden_states=x, topk_output=StandardTopKOutput(weights, ids, torch.zeros(0)))
                y = d.combine(combine_input=experts_on(out, w_gate_up, w_down, first))
            ref = reference(x, ids, weights, w_gate_up, w_down)
            results.append({"format": out.format.value, "error": ((y - ref).norm() / ref.norm()).item()})
    return results


@pytest.mark.parametrize("dispatcher", ["deep_ep", "moe_sbo"])
def test_auto_mode_switches_per_batch(dispatcher, ranks2):
    for results in ranks2.run(auto_mode_rank, dispatcher):
        assert [r["format"] for r in results] == ["deepep_normal", "deepep_ll", "deepep_ll", "deepep_normal"]
        assert max(r["error"] for r in results) <= TOLERANCE[torch.float32], results
