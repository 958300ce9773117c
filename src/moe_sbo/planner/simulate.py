"""The simulator: one layer's predicted timeline per overlap mode, with or without two-batch overlap.

A layer is a list of ops in the order the host issues them, each on one lane: ``compute`` (the SMs:
one CUDA stream's kernels in order; side-stream work is placed where it is launched, since it
shares the SMs) or ``wire`` (the transfer of one all-to-all). An op starts when its lane is free and
the ops it waits for are done. A CUDA-graph forward is just these; an eager one, timed with the ranks
lined up as the benchmarks do, first waits for its host (``StageCosts.host``: the measured excess of
eager over graph forwards), once per micro-batch.

What each overlap mode changes is only where the shared experts are issued (``overlap/sbo.py``):
``none`` after the combine; ``dispatch`` right after the dispatch transfer starts; ``combine`` before
the combine's reduction (launched first, so the transfer waits for the SMs it took); ``combine_sm``
after the combine transfer starts, slowed by its SM budget; ``split`` its gate/up projection (2/3 of
its FLOPs) in the dispatch window and its down projection in the combine window; ``auto`` the fastest
of those. A GEMM that runs while a transfer that needs SMs is in flight is stretched by
(1 - overlap efficiency) x the time they overlap (``Contention``), except the routed experts' bf16
grouped GEMM (``torch._grouped_mm``): a persistent kernel with one CTA per SM it plans for, so the
CTAs whose SMs the transfer holds start when the transfer ends and then do a whole share, and the
GEMM ends a full GEMM time after the transfer (measured on 2x H200, SIMULATION.md section 5). A
``gemm_sm_budget`` (TBO) plans the GEMMs for fewer SMs instead: no wait, each GEMM slower as the
contention probe measured a GEMM planned for that many SMs. With few rows per expert bf16 experts
run a Triton kernel instead (``dense_path``: today's code the grouped GEMV, then the tiled grouped
GEMM, by rows per expert; older code by its own rule; a row's recorded path first): the weights of
the experts with rows (``StageCosts.triton_us``), an ordinary grid of programs (stretched, never
held back) that no SM budget plans. Two-batch overlap (``model/tbo.py``) cuts the tokens in two
and interleaves the micro-batches' three stages — [attention, router, dispatch launch] [dispatch
wait, routed experts, combine launch] [combine wait, shared, residual] — ``delay`` stages apart:
A0 B0 A1 B1 A2 B2 at delay 0.

Bytes per phase (``phase_bytes``) follow the dispatcher: ``blocks`` (low_latency: P - 1 capacity
blocks whatever the routing), ``alltoall`` (each token once per remote destination rank),
``allgather`` (every token to every peer), or, for DeepEP-style scale-out over nodes of 8 GPUs,
``node_dedup`` (prefill: one RDMA copy per remote *node*, forwarded over NVLink) and ``per_rank``
(decode: one copy per remote rank, RDMA for other nodes). Fan-out is the planner's exact uniform
model under the model's group limit (``bytes.expected_fanout``), which is what bounds DeepSeek-V3's
RDMA bytes per token: its top-4 groups of 32 experts reach at most 4 nodes while a group fits in a
node (EP <= 64), 8 at EP128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

import torch

from ..config import MoEConfig
from ..dispatch.ll_wire import RowFormat
from ..overlap.sbo import FIXED_MODES
from .bytes import Fanout, combine_row_bytes, dispatch_row_bytes, expected_fanout
from .simulate_fit import GEMV_MAX_ROWS, SM_TRANSPORTS, TRITON_FITS, WEIGHT_B, StageCosts, kernel_by_rule, smooth_max
from .simulate_rows import (
    BY_ROWS_PER_EXPERT,
    BY_ROWS_TILED_TO_128,
    GEMV_BY_ROWS,
    GROUPED_MM_ONLY,
    DispatchPath,
)

COMPUTE, WIRE = "compute", "wire"
# Share of the shared experts' FLOPs in the gate/up projection (gate and up [2I, H] vs down [H, I]).
SPLIT_FIRST_SHARE = 2 / 3


@dataclass(frozen=True)
class AttentionShape:
    """The attention block the TBO benchmarks time (``bench --tbo``): multi-head attention with
    ``kv_heads`` key/value heads, a stand-in for DeepSeek-V3's MLA (128 heads x 128 dims, 8 KV heads)."""

    heads: int = 128
    kv_heads: int = 8
    head_dim: int = 128

    def params(self, hidden: int) -> int:
        return 2 * hidden * self.head_dim * (self.heads + self.kv_heads)


@dataclass(frozen=True)
class Setup:
    """One layer to predict: the model, EP size P, tokens per rank (decode: sequences, one new token
    each), the dispatcher path, the wire (``nvlink``, ``emulated-internode``, or ``cluster``: NVLink
    inside a node of ``gpus_per_node``, RDMA between), CUDA graph or eager, overlap mode, two-batch
    overlap and its delay (and the SMs its GEMMs plan for), and, for a decoder layer, the regime
    (``prefill``/``decode``) and attention."""

    cfg: MoEConfig
    ep: int
    tokens: int
    path: DispatchPath
    wire: str = "nvlink"
    graph: bool = True
    overlap: str = "none"
    tbo: bool = False
    delay: int = 0
    regime: str | None = None
    sequences: int = 1
    kv_len: int = 0
    attention: AttentionShape = AttentionShape()
    expert_dtype: str = "bf16"
    bytes_scheme: str = "alltoall"
    capacity: int | None = None
    measured_bytes: tuple[float, float] | None = None  # (dispatch, combine) bytes per rank, as a row recorded
    gpus_per_node: int = 8
    gemm_sm_budget: int | None = None  # TBO: the SMs its GEMMs plan for (``tbo_forward``'s); None: all
    # How the bf16 experts chose their GEMMs (``dense_path``): the rule of the code, one of
    # ``simulate_rows.DENSE_RULES`` (a measured row's code's; today's for a new setup), unless
    # ``expert_path`` records the path that ran ("gemv", "tiled" or "grouped_mm"; rows that have it).
    dense_rule: str = BY_ROWS_PER_EXPERT
    expert_path: str | None = None

    @property
    def experts_per_gpu(self) -> int:
        return self.cfg.num_experts // self.ep


@dataclass(frozen=True)
class Op:
    """One step of the layer: ``gpu_us`` on its lane once the ops named in ``after`` are done (and the
    ops before it on its lane). ``kind`` colours it (``host``: an eager forward's wait for its host);
    ``sm_transfer``: a wire op whose transfer runs on SMs; ``persistent``: a compute op that is one
    persistent kernel over every SM, which an SM transfer in flight at its start holds back until the
    transfer ends."""

    name: str
    kind: str
    lane: str
    gpu_us: float
    after: tuple[str, ...] = ()
    sm_transfer: bool = False
    persistent: bool = False


@dataclass(frozen=True)
class SimSpan:
    """One bar of the predicted timeline (the fields of ``measure.trace.Span``)."""

    lane: str
    kind: str
    start_us: float
    dur_us: float
    name: str


@dataclass(frozen=True)
class Prediction:
    """A predicted layer: its time, its timeline, the host time it waits for (eager), the mode chosen."""

    setup: Setup
    t_layer_us: float
    spans: tuple[SimSpan, ...]
    host_us: float
    overlap: str


# ---- bytes and transfers --------------------------------------------------------------------------


@cache
def fanout(cfg: MoEConfig, ep: int, gpus_per_node: int) -> Fanout:
    """``bytes.expected_fanout``, kept: its exact rational sums are costly and a sweep asks often."""
    return expected_fanout(cfg, ep, gpus_per_node)


def remote_nodes_per_token(cfg: MoEConfig, ep: int, gpus_per_node: int) -> float:
    """Expected distinct *other* nodes a token's experts sit on: the node-level fan-out (a node holds
    ``gpus_per_node`` ranks' experts), times (N - 1) / N for a uniformly placed source node."""
    nodes = math.ceil(ep / gpus_per_node)
    if nodes <= 1:
        return 0.0
    return fanout(cfg, nodes, 1).expected_remote_ranks


def phase_bytes(setup: Setup, tokens: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """((dispatch in-node, dispatch other-node), (combine in-node, combine other-node)) bytes one rank
    sends for ``tokens`` of its tokens (one micro-batch under TBO)."""
    cfg, p = setup.cfg, setup.ep
    if p <= 1 or tokens <= 0:
        return (0.0, 0.0), (0.0, 0.0)
    dtype = setup.path.dispatch_dtype or "bf16"
    row_d, row_c = dispatch_row_bytes(cfg, dtype).total_B, combine_row_bytes(cfg, "bf16").total_B
    scheme = setup.bytes_scheme
    if scheme == "measured" and setup.measured_bytes is not None:
        share = 1.0 if setup.path.dispatcher == "low_latency" else tokens / setup.tokens
        d, c = setup.measured_bytes
        return (d * share, 0.0), (c * share, 0.0)
    if scheme in ("blocks", "measured") and setup.path.dispatcher == "low_latency":
        # Fixed blocks of the capacity, in low_latency's own packed row format.
        row_ll = RowFormat.make(cfg.hidden_size, cfg.num_experts_per_tok, torch.bfloat16, dtype == "fp8").row_bytes
        blocks = (p - 1) * (setup.capacity or setup.tokens)
        return (blocks * row_ll, 0.0), (blocks * row_c, 0.0)
    if scheme == "allgather":
        return ((p - 1) * tokens * row_d, 0.0), ((p - 1) * tokens * row_c, 0.0)
    fan = fanout(cfg, p, setup.gpus_per_node)
    if scheme == "node_dedup":
        other = tokens * remote_nodes_per_token(cfg, p, setup.gpus_per_node)
        inside = tokens * fan.expected_remote_ranks  # every remote destination gets its copy over NVLink
        return (inside * row_d, other * row_d), (inside * row_c, other * row_c)
    if scheme == "per_rank" or setup.wire == "cluster":
        inside, other = tokens * fan.expected_intranode_ranks, tokens * fan.expected_internode_ranks
        return (inside * row_d, other * row_d), (inside * row_c, other * row_c)
    remote = tokens * fan.expected_remote_ranks  # alltoall on one wire: every remote rank alike
    return (remote * row_d, 0.0), (remote * row_c, 0.0)


def transfer_us(setup: Setup, cal: StageCosts, inside_B: float, other_B: float) -> float:
    """One all-to-all: on one link class, latency + bytes / bandwidth; over a cluster, the NVLink
    and RDMA parts run at once, so the slower one (with its latency) sets the time."""
    if inside_B + other_B <= 0:
        return 0.0
    if setup.wire != "cluster":
        return cal.link(setup.wire).time_us(inside_B + other_B)
    nvlink, rdma = cal.link("nvlink"), cal.link("rdma")
    if other_B <= 0:
        return nvlink.time_us(inside_B)
    return rdma.latency_us + max(inside_B / (nvlink.GBps * 1e3), other_B / (rdma.GBps * 1e3))


# ---- ops of one micro-batch -----------------------------------------------------------------------


def expert_input_rows(setup: Setup, tokens: int) -> float:
    """The rows a rank's routed experts are handed for ``tokens`` of its tokens, padding included: what
    ``RoutedExperts.dense_path`` chooses by. low_latency hands P x capacity x top-k fixed slots
    whatever the routing (its capacity as ``phase_bytes`` takes it); the other dispatchers the
    (token, expert) pairs that land on the rank, T x top-k on average."""
    top_k = setup.cfg.num_experts_per_tok
    if setup.path.dispatcher == "low_latency":
        return setup.ep * (setup.capacity or setup.tokens) * top_k
    return tokens * top_k


def dense_path(setup: Setup, tokens: int) -> str | None:
    """Which GEMMs the bf16 routed experts of ``tokens`` run, by ``RoutedExperts.dense_path``'s names:
    ``"gemv"``, ``"tiled"`` or ``"grouped_mm"``; None for FP8 experts (their own grouped GEMM). A row's
    recorded ``expert_path`` first; else the rule of its code (``kernels="auto"`` on CUDA, which every
    result file without the field ran) over the rows handed to the experts: today's by the real rows
    to expect per expert (``experts.kernel_by_rows``; the code between ``TILED_SINCE`` and
    ``TILED_512_SINCE`` the same with the tiled GEMM up to ``TILED_MAX_BEFORE`` rows per expert), the
    code between ``GEMV_SINCE`` and ``TILED_SINCE`` the GEMV up to ``GEMV_MAX_ROWS`` rows in all,
    padding included, older code ``torch._grouped_mm`` at every size."""
    if setup.expert_dtype != "bf16":
        return None
    if setup.expert_path is not None:
        return setup.expert_path
    rows = expert_input_rows(setup, tokens)
    if setup.dense_rule in (BY_ROWS_PER_EXPERT, BY_ROWS_TILED_TO_128):
        # Today's code counts the rows to expect (``DispatchOutput.expected_rows``): low_latency's
        # P x C x K fixed rows hold C x K real ones on average (the same at EP1, where every file of
        # this rule was measured).
        expected = rows / setup.ep if setup.path.dispatcher == "low_latency" else rows
        return kernel_by_rule(setup.dense_rule, expected / setup.experts_per_gpu)
    if setup.dense_rule == GEMV_BY_ROWS:
        return "gemv" if rows <= GEMV_MAX_ROWS else "grouped_mm"
    if setup.dense_rule == GROUPED_MM_ONLY:
        return "grouped_mm"
    raise ValueError(f"dense_rule must be one of the simulate_rows.DENSE_RULES, got {setup.dense_rule!r}")


def attention_us(setup: Setup, cal: StageCosts, tokens: int, sequences: int) -> float:
    """Attention GPU time: the bf16 roofline of its projections' weights (+ the KV cache a decode
    step reads) against its FLOPs, plus the fixed cost fitted per regime to the TBO rows."""
    if setup.regime is None or tokens <= 0:
        return 0.0
    a, hidden, fit = setup.attention, setup.cfg.hidden_size, cal.gemm["bf16"]
    params = a.params(hidden)
    flops, read_B = 2.0 * tokens * params, 2.0 * params
    if setup.regime == "prefill":
        length = tokens / max(1, sequences)
        flops += 2.0 * max(1, sequences) * length * length * a.heads * a.head_dim  # causal QK^T and PV
    else:
        flops += 4.0 * sequences * setup.kv_len * a.heads * a.head_dim
        read_B += sequences * (setup.kv_len + 1) * 2 * a.kv_heads * a.head_dim * 2
    roofline = smooth_max(read_B / (fit.weight_GBps * 1e3), flops / (fit.TFLOPs * 1e6), fit.knee)
    return roofline + cal.attention_us.get(setup.regime, 0.0)


def stage_ops(setup: Setup, cal: StageCosts, mb: str, tokens: int, sequences: int, mode: str) -> list[list[Op]]:
    """The three stages of one micro-batch (``mb``: "" alone, "A"/"B" under TBO) in ``mode``."""
    cfg, path, eager = setup.cfg, setup.path, not setup.graph

    (d_in, d_out), (c_in, c_out) = phase_bytes(setup, tokens)
    sm = (path.transport or "nccl") in SM_TRANSPORTS or setup.wire == "cluster"
    shared = cal.shared_gpu(tokens) if cfg.num_shared_experts and tokens > 0 else 0.0
    rows = tokens * cfg.num_experts_per_tok  # the (token, expert) pairs the routed experts run
    dense = dense_path(setup, tokens)
    routed = cal.routed_gpu_us(cfg, setup.experts_per_gpu, rows, setup.expert_dtype, path, dense)
    name = (mb + " " if mb else "") + "{}"
    n = name.format

    # GEMMs planned for fewer SMs (TBO's gemm_sm_budget) are slower, as the contention probe measured
    # a GEMM on fewer SMs, and none waits. The budget is an SM carve-out that cuBLAS and
    # torch._grouped_mm plan for; the Triton GEMV's and tiled GEMM's grids (one program per expert or
    # tile, as many as the rows need) ignore it, so their time is their own.
    budget = setup.gemm_sm_budget if setup.tbo else None
    gemm_slowdown = cal.contention.gemm_slowdown(budget) if budget else 1.0
    routed_slowdown = 1.0 if dense in TRITON_FITS else gemm_slowdown
    # The bf16 experts' torch._grouped_mm is persistent at every size (its tiles outnumber the SMs even
    # at decode: 16+ experts x 32+ column tiles), so code before the GEMV was persistent at decode too.
    persistent = budget is None and dense == "grouped_mm"

    def shared_op(label: str, share: float, slowdown: float = 1.0) -> Op:
        return Op(n(label), "shared_experts", COMPUTE, shared * share * slowdown * gemm_slowdown)

    # An eager forward's excess over its CUDA-graph schedule (host launches, the host reading sizes,
    # waiting for the slower peer; ``StageCosts.host``) goes first: with ranks lined up the GPU waits
    # for it, and each micro-batch of two-batch overlap pays its own.
    overhead = cal.host_us(path, tokens) if eager and tokens else 0.0
    s0 = [Op(n("eager host time"), "host", COMPUTE, overhead)]
    if setup.regime is not None:
        s0.append(Op(n("attention"), "attention", COMPUTE, attention_us(setup, cal, tokens, sequences) * gemm_slowdown))
    s0.append(Op(n("router"), "router", COMPUTE, cal.router_us(path, tokens) if tokens else 0.0))
    wire_d = transfer_us(setup, cal, d_in, d_out)
    s0.append(Op(n("dispatch transfer"), "comm", WIRE, wire_d, (n("router"),), sm))
    if mode == "dispatch":
        s0.append(shared_op("shared experts", 1.0))
    elif mode == "split":
        s0.append(shared_op("shared gate/up", SPLIT_FIRST_SHARE))

    layout = cal.kernel_us(path, "dispatch", tokens)
    s1 = [
        Op(n("dispatch layout"), "dispatch", COMPUTE, layout, (n("dispatch transfer"),)),
        Op(n("routed experts"), "routed_experts", COMPUTE, routed * routed_slowdown, persistent=persistent),
    ]
    if mode == "combine":
        s1.append(shared_op("shared experts", 1.0))
    s1.append(Op(n("combine reduce"), "combine", COMPUTE, cal.kernel_us(path, "combine", tokens)))
    wire_c = transfer_us(setup, cal, c_in, c_out)
    s1.append(Op(n("combine transfer"), "comm", WIRE, wire_c, (n("combine reduce"),), sm))
    if mode == "combine_sm":
        s1.append(shared_op("shared experts", 1.0, cal.contention.sm_budget_slowdown))
    elif mode == "split":
        s1.append(shared_op("shared down", 1 - SPLIT_FIRST_SHARE))

    s2 = [Op(n("combine wait"), "combine", COMPUTE, 0.0, (n("combine transfer"),))]
    if mode == "none":
        s2.append(shared_op("shared experts", 1.0))
    return [s0, s1, s2]


# ---- schedule -------------------------------------------------------------------------------------


def interleave(stages_a: list[list[Op]], stages_b: list[list[Op]], delay: int) -> list[Op]:
    """Issue order of two micro-batches as ``stages.run_interleaved`` runs them: A ``delay`` stages
    ahead, then A, B alternating."""
    order = [("a", i) for i in range(min(delay, len(stages_a)))]
    a, b = min(delay, len(stages_a)), 0
    while a < len(stages_a) or b < len(stages_b):
        if a < len(stages_a):
            order.append(("a", a))
            a += 1
        if b < len(stages_b):
            order.append(("b", b))
            b += 1
    return [op for which, i in order for op in (stages_a if which == "a" else stages_b)[i]]


def schedule(ops: list[Op], overlap_efficiency: float) -> tuple[list[SimSpan], float]:
    """Place ``ops`` in issue order: (spans, layer time). A compute op that overlaps a transfer on
    SMs is stretched by (1 - ``overlap_efficiency``) x the overlap; a ``persistent`` one that starts
    while such a transfer is in flight ends its whole time after the transfer does."""
    free = {COMPUTE: 0.0, WIRE: 0.0}
    ends: dict[str, float] = {}
    transfers: list[tuple[float, float]] = []
    spans: list[SimSpan] = []
    for op in ops:
        start = max([free[op.lane]] + [ends[a] for a in op.after if a in ends])
        dur = op.gpu_us
        in_flight = [e for s, e in transfers if s <= start < e] if op.persistent and dur > 0 else []
        if in_flight:
            dur += max(in_flight) - start
        elif op.lane == COMPUTE and dur > 0 and op.kind != "host":
            overlap = sum(max(0.0, min(e, start + dur) - max(s, start)) for s, e in transfers)
            dur += (1.0 - overlap_efficiency) * overlap
        ends[op.name] = free[op.lane] = start + dur
        if op.lane == WIRE and op.sm_transfer and dur > 0:
            transfers.append((start, start + dur))
        if dur > 0:
            spans.append(SimSpan(op.lane, op.kind, start, dur, op.name))
    return spans, max([0.0, *ends.values()])


def _split(total: int) -> tuple[int, int]:
    return (total + 1) // 2, total // 2


def predict(setup: Setup, cal: StageCosts) -> Prediction:
    """The layer's predicted time and timeline (``auto``: the fastest fixed mode)."""
    if setup.overlap == "auto":
        fixed = [predict(replace(setup, overlap=m), cal) for m in FIXED_MODES]
        best = min(fixed, key=lambda p: p.t_layer_us)
        return Prediction(setup, best.t_layer_us, best.spans, best.host_us, best.overlap)
    if setup.overlap not in FIXED_MODES:
        raise ValueError(f"overlap must be one of {[*FIXED_MODES, 'auto']}, got {setup.overlap!r}")
    if setup.tbo:
        (ta, tb), (sa, sb) = _split(setup.tokens), _split(setup.sequences)
        if setup.regime == "prefill" and setup.sequences == 1:
            sa = sb = 1  # one sequence cut in two: each half is a segment
        ops = interleave(
            stage_ops(setup, cal, "A", ta, sa, setup.overlap),
            stage_ops(setup, cal, "B", tb, sb, setup.overlap),
            setup.delay,
        )
    else:
        ops = [op for stage in stage_ops(setup, cal, "", setup.tokens, setup.sequences, setup.overlap) for op in stage]
    spans, total = schedule(ops, cal.contention.overlap_efficiency)
    host = sum(op.gpu_us for op in ops if op.kind == "host")
    return Prediction(setup, total, tuple(spans), host, setup.overlap)


def back_to_back_us(setup: Setup, cal: StageCosts) -> float:
    """Eager forwards issued back to back: the host issues the next while the GPU runs this one, so
    a forward takes the longer of its host time and its GPU time (the CUDA-graph schedule)."""
    return max(predict(setup, cal).host_us, predict(replace(setup, graph=True), cal).t_layer_us)


def dense_layer_us(cfg: MoEConfig, cal: StageCosts, tokens: int, dense_inter: int, setup: Setup) -> float:
    """A dense decoder layer (DeepSeek-V3's first ``first_k_dense_replace``): attention + a bf16 MLP."""
    mlp = cal.gemm["bf16"].time_us(1, tokens, cfg.hidden_size, dense_inter, WEIGHT_B["bf16"])
    return attention_us(setup, cal, tokens, setup.sequences) + mlp
