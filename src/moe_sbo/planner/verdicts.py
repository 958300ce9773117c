"""Overlap verdicts and the plan: for each mode (none, SBO, TBO) a window, the work to hide in it, the rest.

What is hard: the windows come from the worked example's own T and t and the link's predicted transfer times, but
the work SBO hides behind a transfer -- the shared-expert MLP -- is an *estimate*: a roofline at the
datasheet peak, scaled by ``SHARED_EXPERT_EFFICIENCY`` from this project's own H200 probe
(``shared_expert_time_us``). Each verdict's explanation names the numbers it used, so an estimate is never
read as a measurement. ``scheme_comparison`` sets allgather against alltoall on the same link; ``make_plan``
and ``plan_to_json`` gather everything, with the worked example's figures beside the byte model's and the weight
memory per GPU (``memory.weight_memory``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..config import MoEConfig, divisors
from .bytes import ByteModel, a2a_time_us, byte_model, combine_row_bytes, dispatch_row_bytes, node_sizes, resolve_fanout
from .inputs import B_PER_US_PER_GBPS, ELEMENT_B, SHARED_EXPERT_EFFICIENCY, Hardware, PlanInputs, get_hardware
from .links import Calibration, Link, datasheet_link, transfer_time_us
from .memory import WeightMemory, weight_memory
from .worked_example import SeedFigure, seed_figures

# --------------------------------------------------------------------------------------------------
# Overlap verdicts
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SharedExpertEstimate:
    """Roofline *estimate* of the shared-expert MLP (gate, up, down) on ``tokens`` tokens."""

    tokens: int
    flops: float
    bytes_moved_B: float
    compute_us: float
    memory_us: float
    time_us: float
    bound: str
    note: str


def shared_expert_time_us(
    cfg: MoEConfig, tokens: int, hw: Hardware, weight_dtype: str = "bf16"
) -> SharedExpertEstimate:
    """max(FLOPs / peak, bytes / HBM) / efficiency: the weights are read once, activations in bf16."""
    inter = cfg.shared_intermediate_size
    weights = 3 * cfg.hidden_size * inter
    flops = 2.0 * tokens * weights
    bytes_moved_B = weights * ELEMENT_B[weight_dtype] + tokens * (2 * cfg.hidden_size + 3 * inter) * 2
    peak_TFLOPs = hw.fp8_TFLOPs if weight_dtype == "fp8" else hw.bf16_TFLOPs
    compute_us = flops / (peak_TFLOPs * 1e6) / SHARED_EXPERT_EFFICIENCY
    memory_us = bytes_moved_B / (hw.hbm_GBps * B_PER_US_PER_GBPS) / SHARED_EXPERT_EFFICIENCY
    return SharedExpertEstimate(
        tokens=tokens,
        flops=flops,
        bytes_moved_B=bytes_moved_B,
        compute_us=compute_us,
        memory_us=memory_us,
        time_us=max(compute_us, memory_us),
        bound="compute" if compute_us >= memory_us else "memory",
        note=f"estimate: roofline at {hw.name} datasheet peak x {SHARED_EXPERT_EFFICIENCY} efficiency",
    )


@dataclass(frozen=True)
class OverlapVerdict:
    """Can ``work_us`` hide inside ``window_us``? ``left_us`` = window - work (negative: exposed)."""

    mode: str
    window_us: float | None
    work_us: float | None
    left_us: float | None
    fits: bool | None
    explanation: str


def overlap_verdicts(inp: PlanInputs, model: ByteModel, link: Link, hw: Hardware) -> list[OverlapVerdict]:
    """none, SBO (dispatch, combine) and TBO, each as a window, the work to fit in it, and what is left."""
    cfg, fan = inp.model, model.fanout
    t_dispatch_us = a2a_time_us(inp.batch, model.dispatch_row, fan, link)
    t_combine_us = a2a_time_us(inp.batch, model.combine_row, fan, link)
    verdicts = []

    # none: communication is serial with compute; its window is what TPOT leaves after compute.
    layer_share_us = inp.tpot_ms * 1000.0 / model.layers
    window = (layer_share_us - inp.attn_us - inp.moe_us) / 2
    work = max(t_dispatch_us, t_combine_us)
    verdicts.append(
        OverlapVerdict(
            "none",
            window,
            work,
            window - work,
            window >= work,
            f"per a2a: (TPOT/layers - T - t) / 2 = ({layer_share_us:.0f} - {inp.attn_us:g} - {inp.moe_us:g}) / 2 us "
            f"vs slower a2a of the batch ({t_dispatch_us:.1f} dispatch / {t_combine_us:.1f} combine us)"
            + ("; compute alone exceeds the TPOT share" if window < 0 else ""),
        )
    )

    # SBO: the shared expert hides behind the transfer it runs beside.
    if cfg.num_shared_experts == 0:
        for mode in ("sbo-dispatch", "sbo-combine"):
            verdicts.append(OverlapVerdict(mode, None, None, None, None, f"n/a: {cfg.name} has no shared expert"))
    else:
        shared = shared_expert_time_us(cfg, inp.batch, hw, inp.weight_dtype)
        for mode, transfer_us in (("sbo-dispatch", t_dispatch_us), ("sbo-combine", t_combine_us)):
            left = transfer_us - shared.time_us
            verdicts.append(
                OverlapVerdict(
                    mode,
                    transfer_us,
                    shared.time_us,
                    left,
                    left >= 0,
                    f"shared expert {shared.time_us:.1f} us ({shared.bound}-bound {shared.note}) inside the "
                    f"{mode.split('-')[1]} transfer {transfer_us:.1f} us; "
                    f"hides {min(transfer_us, shared.time_us):.1f} us",
                )
            )

    # TBO: with two micro-batches, each a2a must finish in (T - t) / 2 (the worked example's rule).
    if inp.micro_batches == 2:
        window = (inp.attn_us - inp.moe_us) / 2
        td = a2a_time_us(model.tokens_per_a2a, model.dispatch_row, fan, link)
        tc = a2a_time_us(model.tokens_per_a2a, model.combine_row, fan, link)
        work = max(td, tc)
        verdicts.append(
            OverlapVerdict(
                "tbo",
                window,
                work,
                window - work,
                window >= work,
                f"(T - t) / 2 = {window:g} us vs the slower a2a of a {model.tokens_per_a2a}-token micro-batch "
                f"({td:.1f} dispatch / {tc:.1f} combine us); sum form td + tc = {td + tc:.1f} <= T - t = "
                f"{inp.attn_us - inp.moe_us:g} us is {'met' if td + tc <= inp.attn_us - inp.moe_us else 'not met'}",
            )
        )
    else:
        verdicts.append(OverlapVerdict("tbo", None, None, None, None, "off: --micro-batches 1"))
    return verdicts


@dataclass(frozen=True)
class SchemeRow:
    """Per-GPU bytes and predicted time per layer (dispatch + combine) for the two schemes at one EP."""

    ep: int
    expected_remote_ranks: float
    allgather_B: float
    alltoall_B: float
    ratio: float
    allgather_us: float
    alltoall_us: float


@dataclass(frozen=True)
class SchemeComparison:
    rows: tuple[SchemeRow, ...]
    crossover_ep: int | None
    note: str


def scheme_comparison(inp: PlanInputs, link: Link, max_ep: int = 256) -> SchemeComparison:
    """allgather + reduce-scatter (every token to every rank) vs alltoall (each token to its ranks).

    allgather: each GPU sends its T rows to the P - 1 others and receives back (P - 1) x T combine rows'
    worth in the reduce-scatter: (P - 1) x T x (dispatch row + combine row). alltoall: expected remote
    ranks x T x the same rows, plus one extra latency for the count exchange before the data.
    Crossover: the smallest EP at which the alltoall's predicted time beats the allgather's.
    """
    cfg = inp.model
    d_B = dispatch_row_bytes(cfg, inp.dispatch_dtype).total_B
    c_B = combine_row_bytes(cfg, inp.combine_dtype).total_B
    rows = []
    for ep in (p for p in divisors(cfg.num_experts) if 2 <= p <= max_ep):
        fan = resolve_fanout(cfg, ep, link.gpus_per_node, inp.fanout_model)
        nodes = node_sizes(ep, link.gpus_per_node)
        # allgather peers: (node size - 1) inside the node, the rest through the NIC, averaged over ranks.
        ag_intra = sum(n - 1 for n in nodes) / ep
        ag_inter = (ep - 1) - ag_intra
        ag_us = sum(
            transfer_time_us(inp.batch * ag_intra * row_B, inp.batch * ag_inter * row_B, link) for row_B in (d_B, c_B)
        )
        a2a_us = link.latency_us + sum(
            transfer_time_us(
                inp.batch * fan.expected_intranode_ranks * row_B, inp.batch * fan.expected_internode_ranks * row_B, link
            )
            for row_B in (d_B, c_B)
        )
        ag_B = (ep - 1) * inp.batch * (d_B + c_B)
        a2a_B = fan.expected_remote_ranks * inp.batch * (d_B + c_B)
        rows.append(SchemeRow(ep, fan.expected_remote_ranks, ag_B, a2a_B, ag_B / a2a_B, ag_us, a2a_us))
    crossover = next((row.ep for row in rows if row.alltoall_us < row.allgather_us), None)
    note = (
        f"alltoall beats allgather from EP{crossover} at batch {inp.batch}"
        if crossover
        else f"allgather is never slower up to EP{max_ep} at batch {inp.batch}"
    )
    return SchemeComparison(tuple(rows), crossover, note)


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    hardware: Hardware
    link: Link
    seed: tuple[SeedFigure, ...]
    bytes: ByteModel
    t_dispatch_us: float
    t_combine_us: float
    comm_ms_per_step: float
    verdicts: tuple[OverlapVerdict, ...]
    schemes: SchemeComparison
    weight_memory: WeightMemory
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def compute_ms(self) -> float:
        """Compute alone per decode step: MoE layers x (T + t), ms."""
        return self.bytes.layers * (self.inputs.attn_us + self.inputs.moe_us) / 1000

    @property
    def compute_exceeds_tpot(self) -> bool:
        """Compute alone takes longer than the TPOT: no overlap can meet it, whatever it hides."""
        return self.inputs.attn_us > 0 and self.compute_ms > self.inputs.tpot_ms


def make_plan(inp: PlanInputs, calibration: Calibration | None = None) -> Plan:
    hw = get_hardware(inp.hw)
    link = calibration.link(hw) if calibration is not None else datasheet_link(hw)
    model = byte_model(inp, link.gpus_per_node)
    td = a2a_time_us(inp.batch, model.dispatch_row, model.fanout, link)
    tc = a2a_time_us(inp.batch, model.combine_row, model.fanout, link)
    notes = []
    if hw.gpus_per_node > 1 and inp.ep > hw.gpus_per_node:
        notes.append(
            f"EP{inp.ep} spans {math.ceil(inp.ep / hw.gpus_per_node)} nodes: "
            f"{model.fanout.expected_internode_ranks:.2f} of {model.fanout.expected_remote_ranks:.2f} remote "
            f"ranks per token go through the {link.nic_GBps:g} GB/s NIC"
        )
    return Plan(
        inputs=inp,
        hardware=hw,
        link=link,
        seed=tuple(seed_figures(inp)),
        bytes=model,
        t_dispatch_us=td,
        t_combine_us=tc,
        comm_ms_per_step=model.layers * (td + tc) / 1000,
        verdicts=tuple(overlap_verdicts(inp, model, link, hw)),
        schemes=scheme_comparison(inp, link),
        weight_memory=weight_memory(inp.model, inp.memory_ep_sizes, inp.model_shapes),
        notes=tuple(notes),
    )


def closing_verdict(plan: Plan) -> str:
    """The plan's last line, at most 100 columns: when compute alone exceeds the TPOT, that no
    overlap fits (whatever each hides); else whether the batch's all-to-all fits its share of the
    TPOT run serially (mode none), and which overlaps fit their window (or, when none does, the
    closest and by how much it misses)."""
    inp = plan.inputs
    if plan.compute_exceeds_tpot:
        return (
            f"verdict: no overlap fits: compute alone is {plan.compute_ms:.1f} ms "
            f"({plan.bytes.layers} x {inp.attn_us + inp.moe_us:g} us) > {inp.tpot_ms:g} ms TPOT"
        )
    judged = {v.mode: v for v in plan.verdicts if v.fits is not None and v.left_us is not None}
    serial = judged.pop("none", None)
    line = "verdict: " + (
        f"serial a2a {'fits' if serial.fits else 'misses'} the {inp.tpot_ms:g} ms TPOT; " if serial else ""
    )
    fitting = [mode for mode, v in judged.items() if v.fits]
    if fitting or not judged:
        return line + f"overlaps that fit: {', '.join(fitting) or 'none judged'}"
    closest = max(judged.values(), key=lambda v: v.left_us or 0.0)
    return line + f"no overlap fits (closest: {closest.mode}, {-(closest.left_us or 0.0):.0f} us/layer short)"


@dataclass(frozen=True)
class NodeVerdict:
    """Flat against node-aware dispatch at one EP size of whole nodes, judged by the windows the
    plan judges ``--ep`` by: the faster of the two, by how much, and whether its slower phase fits
    the serial window ((TPOT/layers - T - t) / 2, the batch) and TBO's ((T - t) / 2, a micro-batch)."""

    ep: int
    num_nodes: int
    faster: str  # "node-aware" or "flat"
    speedup: float  # the slower's dispatch + combine / the faster's, of the batch
    serial_fits: bool
    tbo_fits: bool | None  # None with one micro-batch


def node_verdicts(plan: Plan, link: Link, ep_sizes: tuple[int, ...]) -> list[NodeVerdict]:
    """``NodeVerdict`` per EP size of ``ep_sizes`` (whole nodes of ``link.gpus_per_node``) on ``link``."""
    from .nodes import compare

    inp, layers = plan.inputs, plan.bytes.layers
    serial_window = (inp.tpot_ms * 1000.0 / layers - inp.attn_us - inp.moe_us) / 2
    tbo_window = (inp.attn_us - inp.moe_us) / 2
    args = (inp.dispatch_dtype, inp.combine_dtype)
    batch = compare(inp.model, ep_sizes, inp.batch, link, *args)
    micro = compare(inp.model, ep_sizes, plan.bytes.tokens_per_a2a, link, *args)
    verdicts = []
    for row, micro_row in zip(batch, micro):
        aware = row.node_aware_us < row.flat_us

        def slower_phase(r) -> float:
            phases = (r.dispatch, r.combine)
            return max(p.node_aware_pipelined_us if aware else p.flat_us for p in phases)

        verdicts.append(
            NodeVerdict(
                ep=row.crossings.ep,
                num_nodes=row.crossings.num_nodes,
                faster="node-aware" if aware else "flat",
                speedup=max(row.flat_us, row.node_aware_us) / min(row.flat_us, row.node_aware_us),
                serial_fits=slower_phase(row) <= serial_window,
                tbo_fits=slower_phase(micro_row) <= tbo_window if inp.micro_batches == 2 else None,
            )
        )
    return verdicts


def node_verdict_line(plan: Plan, verdicts: list[NodeVerdict]) -> str:
    """One line for the node table, before the closing verdict: where node-aware dispatch is faster
    and by how much, and at which EP sizes the faster dispatch fits serially or under TBO (unless
    compute alone exceeds the TPOT: then nothing fits, as the closing verdict says)."""

    def eps(items: list[NodeVerdict]) -> str:
        if len(items) == len(verdicts) > 1:
            return "every EP size"
        return "EP" + "/".join(str(v.ep) for v in items) if items else "no EP size"

    aware = [v for v in verdicts if v.faster == "node-aware"]
    if aware:
        low, high = min(v.speedup for v in aware), max(v.speedup for v in aware)
        gain = f"{low:.2f}x" if round(low, 2) == round(high, 2) else f"{low:.2f}-{high:.2f}x"
        line = f"verdict across nodes: node-aware {gain} faster at {eps(aware)}"
    else:
        line = "verdict across nodes: flat is faster at every EP size"
    if plan.compute_exceeds_tpot:
        return line + "; compute alone exceeds the TPOT"
    line += f"; serial a2a fits at {eps([v for v in verdicts if v.serial_fits])}"
    if any(v.tbo_fits is not None for v in verdicts):
        line += f"; tbo at {eps([v for v in verdicts if v.tbo_fits])}"
    return line


def plan_to_json(plan: Plan) -> dict:
    """Inputs, the worked example's six quantities (its convention and rounding beside the byte model), the rest."""
    inp, model = plan.inputs, plan.bytes
    seed = {fig.key: fig for fig in plan.seed}

    def metric(key: str, model_value) -> dict:
        fig = seed[key]
        return {
            "formula": fig.formula,
            "seed_exact": fig.exact,
            "seed_exact_unit": fig.exact_unit,
            "seed_rounded": fig.seed_rounded,
            "seed_unit": fig.seed_unit,
            "seed_printed": fig.seed_printed,
            "seed_agreement": fig.agreement,
            "exact_si": fig.exact_si,
            "si_unit": fig.si_unit,
            "model": model_value,
        }

    shapes = inp.model_shapes
    td_mb = a2a_time_us(model.tokens_per_a2a, model.dispatch_row, model.fanout, plan.link)
    tc_mb = a2a_time_us(model.tokens_per_a2a, model.combine_row, model.fanout, plan.link)
    inputs = {k: v for k, v in asdict(inp).items() if k not in ("model", "shapes")}
    inputs.update(
        model=inp.model.name,
        seed_layers=inp.seed_layers,
        model_layers=inp.model_layers,
        memory_ep_sizes=list(inp.memory_ep_sizes),
    )
    return {
        "meta": {
            "tool": "moe_sbo.planner",
            "units": "bytes, us, GBps = 1e9 B/s; worked-example units KB=1024 B, MB=1000 KB, GB=1000 MB",
        },
        "inputs": inputs,
        "model_config": asdict(inp.model),
        "hardware": asdict(plan.hardware),
        "link": asdict(plan.link),
        "bytes_per_token": metric(
            "bytes_per_token",
            {
                "dispatch_row_B": asdict(model.dispatch_row) | {"total_B": model.dispatch_row.total_B},
                "combine_row_B": asdict(model.combine_row) | {"total_B": model.combine_row.total_B},
                "expected_remote_ranks": model.fanout.expected_remote_ranks,
                "per_token_all_destinations_B": model.bytes_per_token_B,
            },
        ),
        "bytes_per_a2a": metric(
            "bytes_per_a2a",
            {
                "tokens_per_a2a": model.tokens_per_a2a,
                "dispatch_B": model.dispatch_bytes_per_a2a_B,
                "combine_B": model.combine_bytes_per_a2a_B,
            },
        ),
        "bytes_per_layer": metric("bytes_per_layer", {"B": model.bytes_per_layer_B}),
        "bytes_per_step": metric("bytes_per_step", {"B": model.bytes_per_step_B, "layers": model.layers}),
        "required_GBps_per_gpu": metric("required_GBps_per_gpu", {"GBps": model.required_GBps_per_gpu}),
        "a2a_budget_us": metric(
            "a2a_budget_us",
            {
                "budget_us": (inp.attn_us - inp.moe_us) / 2,
                "micro_batch_dispatch_us": td_mb,
                "micro_batch_combine_us": tc_mb,
            },
        ),
        "fanout": {k: v for k, v in asdict(model.fanout).items()},
        "transfer": {
            "t_dispatch_us": plan.t_dispatch_us,
            "t_combine_us": plan.t_combine_us,
            "comm_ms_per_step": plan.comm_ms_per_step,
        },
        "verdicts": [asdict(v) for v in plan.verdicts],
        "schemes": {
            "rows": [asdict(r) for r in plan.schemes.rows],
            "crossover_ep": plan.schemes.crossover_ep,
            "note": plan.schemes.note,
        },
        "weight_memory": asdict(plan.weight_memory) | {"shapes": asdict(shapes) if shapes is not None else None},
        "notes": list(plan.notes),
        "compute_ms_per_step": plan.compute_ms,
        "verdict": closing_verdict(plan),
    }


# --------------------------------------------------------------------------------------------------
# Batch sweep
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepPoint:
    batch: int
    t_dispatch_us: float
    t_combine_us: float
    micro_batch_a2a_us: float
    required_GBps_per_gpu: float
    seed_required_GBps_per_gpu: float
    tbo_required_GBps: float | None


def sweep_batches(inp: PlanInputs, batches: list[int], link: Link) -> list[SweepPoint]:
    """The plan at each batch size: a2a times on ``link`` and the bandwidth each budget requires.

    ``tbo_required_GBps``: the link speed at which a micro-batch's slower a2a just fits (T - t) / 2
    after the fixed latency (None when the latency alone does not fit).
    """
    points = []
    window_us = (inp.attn_us - inp.moe_us) / 2
    for batch in batches:
        point_inp = PlanInputs(
            **{
                **{f: getattr(inp, f) for f in inp.__dataclass_fields__},
                "batch": batch,
                "micro_batches": min(inp.micro_batches, batch),
            }
        )
        model = byte_model(point_inp, link.gpus_per_node)
        fan = model.fanout
        td = a2a_time_us(batch, model.dispatch_row, fan, link)
        tc = a2a_time_us(batch, model.combine_row, fan, link)
        mb = max(a2a_time_us(model.tokens_per_a2a, row, fan, link) for row in (model.dispatch_row, model.combine_row))
        mb_B = max(model.dispatch_bytes_per_a2a_B, model.combine_bytes_per_a2a_B)
        usable_us = window_us - link.latency_us
        seed_step = next(f.exact for f in seed_figures(point_inp) if f.key == "bytes_per_step")
        points.append(
            SweepPoint(
                batch=batch,
                t_dispatch_us=td,
                t_combine_us=tc,
                micro_batch_a2a_us=mb,
                required_GBps_per_gpu=model.required_GBps_per_gpu,
                seed_required_GBps_per_gpu=seed_step * 1000.0 / inp.tpot_ms / 1e9,
                tbo_required_GBps=mb_B / usable_us / B_PER_US_PER_GBPS if usable_us > 0 else None,
            )
        )
    return points
