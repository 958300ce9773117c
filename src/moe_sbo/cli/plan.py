"""``moe-sbo plan``: the communication-budget planner on the command line (model in ``planner/``).

It prints what was asked for first (``--node-aware-ep``: flat vs node-aware dispatch; ``--load FILE``
or ``--skew zipf:S``: the expert load balance per EP size, redundant count and placement policy;
``--memory-ep``: the weight memory per GPU), then the byte model (row sizes, fan-out, bytes per
token, a2a, layer and step, the bandwidth) and a verdict per overlap mode, and last the closing
verdict (``planner.closing_verdict``). ``--detail`` adds the published DeepSeek-V3 decode budget (a
worked example from a public analysis of SGLang's overlap with DeepEP) line by line, why each
verdict, allgather vs alltoall per EP and the weight memory.

The hard part is keeping user mistakes out of tracebacks: every bad input becomes a ``ValueError``
in ``planner`` ("<name> must <rule>, got <value>; <fix>"); ``run_plan`` prints it and returns 2.

Wiring: ``parsers.plan.add_arguments(parser)`` adds its options, ``run_plan(args)`` runs it;
``python -m moe_sbo.cli.plan [flags]`` works on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from datetime import datetime, timezone

from .. import planner
from ..measure.options import make_console, make_table, recorded_model, target_load
from ..measure.results import STDOUT, dump_json
from ..measure.run import output_file, output_path
from .parsers import plan as plan_parser
from .parsers.common import HelpFormatter
from .plan_plot import write_plot


def inputs_from_args(args: argparse.Namespace) -> planner.PlanInputs:
    return planner.PlanInputs(
        model=planner.load_model(args.model),
        batch=args.batch,
        tpot_ms=args.tpot_ms,
        layers=args.layers,
        attn_us=args.attn_us,
        moe_us=args.moe_us,
        ep=args.ep,
        hw=args.hw,
        dispatch_dtype=args.dispatch_dtype,
        combine_dtype=args.combine_dtype,
        micro_batches=args.micro_batches,
        weight_dtype=args.weight_dtype,
        fanout_model=args.fanout,
        memory_ep=None if args.memory_ep is None else tuple(args.memory_ep),
        shapes=planner.load_shapes(args.model),
    )


def run_plan(args: argparse.Namespace) -> int:
    """Run the planner; print what was asked for first, then the byte model and the overlap
    verdicts (``--detail``: everything), the verdict last; write ``--json`` / ``--plot``. Returns 0,
    or 2 on bad input."""
    try:
        json_path = output_file("--json", args.json)  # every command: its outputs checked first
        plot_path = output_path("--plot", args.plot)
        args.model = resolve_model(args)
        inp = inputs_from_args(args)
        calibration = planner.calibrate(args.calibrate, ep=inp.ep) if args.calibrate else None
        balance = load_balance_from_args(args, inp.model)
        node_aware = node_aware_from_args(args, inp)
        plan = planner.make_plan(inp, calibration)
        console = make_console(stdout_taken=json_path is STDOUT)
        # What was asked for, first: the tables of --node-aware-ep, --load / --skew, --memory-ep.
        node_line = None
        if node_aware is not None:
            print_node_aware(console, node_aware, inp)
            node_line = planner.node_verdict_line(plan, planner.node_verdicts(plan, node_aware[0], node_aware[2]))
        if balance is not None:
            print_load_balance(console, balance)
        if args.memory_ep is not None:
            print_weight_memory(console, plan.weight_memory)
        print_plan(console, plan, calibration, detail=args.detail)
        if args.detail and args.memory_ep is None:
            print_weight_memory(console, plan.weight_memory)
        if json_path:
            doc = planner.plan_to_json(plan)
            if balance is not None:
                doc["load_balance"] = dataclasses.asdict(balance)
            if node_aware is not None:
                doc["node_aware"] = [
                    {**dataclasses.asdict(row), "flat_us": row.flat_us, "node_aware_us": row.node_aware_us}
                    for row in node_aware[1]
                ]
                doc["node_verdict"] = node_line
            doc["meta"]["arguments"] = {k: v for k, v in vars(args).items() if k != "func"}
            doc["meta"]["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            if calibration is not None:
                doc["calibration"] = vars(calibration)
            dump_json(json_path, doc, indent=2)
            console.print(f"plan written to {json_path}", highlight=False, soft_wrap=True)
        if plot_path:
            write_plot(plan, plot_path)
            console.print(f"plot written to {plot_path}", highlight=False, soft_wrap=True)
        if not args.detail:
            console.print(
                "--detail: worked example, why each verdict, allgather vs alltoall, weight memory",
                style="dim",
                highlight=False,
            )
        if node_line:
            console.print(node_line, highlight=False, soft_wrap=True)
        console.print(planner.closing_verdict(plan), highlight=False, soft_wrap=True)  # one line, for scripts
    except ValueError as exc:
        print(f"moe-sbo plan: error: {exc}", file=sys.stderr)
        return 2
    return 0


def resolve_model(args: argparse.Namespace) -> str:
    """``--model``; without it, the model a ``--load`` file was recorded on, else the seed example's."""
    if args.model is not None:
        return args.model
    recorded = recorded_model(args.load) if args.load and not args.load.startswith("zipf:") else None
    return recorded or planner.SEED_INPUTS["model"]


def load_balance_from_args(args: argparse.Namespace, model) -> planner.LoadBalance | None:
    """The load-balance table ``--load`` or ``--skew`` asks for (None without either); ``ValueError``
    for ``--eplb-ep`` or ``--redundant`` without a load, which would be ignored."""
    spec, flag = (args.load, "--load") if args.load else (args.skew, "--skew")
    if spec is None:
        for given, option in ((args.eplb_ep, "--eplb-ep"), (args.redundant, "--redundant")):
            if given is not None:
                raise ValueError(
                    f"{option} sizes the load-balance table, which needs a load, got {option} without one; "
                    "add --load FILE or --skew zipf:S, or leave it out"
                )
        return None
    if args.load and args.load.startswith("zipf:"):
        raise ValueError(f"--load must be a load file, got {args.load!r}; use --skew {args.load} for a Zipf load")
    target = target_load(spec, model.num_experts, model.name, flag)
    redundant = planner.DEFAULT_REDUNDANT if args.redundant is None else args.redundant
    return planner.load_balance(model, target.load, target.label, args.eplb_ep, redundant)


def node_aware_from_args(
    args: argparse.Namespace, inp: planner.PlanInputs
) -> tuple[planner.Link, list[planner.NodeAwareRow], tuple[int, ...]] | None:
    """Flat vs node-aware dispatch at ``--node-aware-ep`` (None without it), on ``--hw``'s links:
    the link, a row per EP size, the sizes."""
    if not args.node_aware_ep:
        return None
    link = planner.datasheet_link(planner.get_hardware(inp.hw))
    sizes = tuple(args.node_aware_ep)
    bad = [ep for ep in sizes if ep % link.gpus_per_node or ep <= link.gpus_per_node or inp.model.num_experts % ep]
    if bad:
        raise ValueError(
            f"--node-aware-ep must be EP sizes of two or more whole nodes of {link.gpus_per_node} GPUs ({inp.hw}) "
            f"that divide the {inp.model.num_experts} routed experts, got {bad}; e.g. --node-aware-ep 16 32 64"
        )
    rows = planner.compare(inp.model, sizes, inp.batch, link, inp.dispatch_dtype, inp.combine_dtype)
    return link, rows, sizes


# --------------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------------


def print_node_aware(
    console, node_aware: tuple[planner.Link, list[planner.NodeAwareRow], tuple[int, ...]], inp
) -> None:
    """Crossings per token and dispatch + combine time, flat (``alltoall``) vs node-aware."""
    link, rows, _ = node_aware
    table = make_table(
        f"Flat vs node-aware dispatch, {inp.model.name}, {inp.batch} tokens per GPU",
        [
            ("EP", "right"),
            ("nodes", "right"),
            ("nodes/token", "right"),
            ("crossings flat", "right"),
            ("node-aware", "right"),
            ("fewer", "right"),
            ("flat us", "right"),
            ("node-aware us", "right"),
            ("speedup", "right"),
        ],
    )
    for row in rows:
        c = row.crossings
        table.add_row(
            str(c.ep),
            str(c.num_nodes),
            f"{c.expected_nodes:.2f} (<= {c.max_nodes})",
            f"{c.flat_internode:.2f}",
            f"{c.node_aware_internode:.2f}",
            f"{c.internode_ratio:.2f}x",
            f"{row.flat_us:.0f}",
            f"{row.node_aware_us:.0f}",
            f"{row.flat_us / row.node_aware_us:.2f}x",
        )
    console.print(table)
    console.print(
        f"links: NVLink {link.nvlink_GBps:g} GB/s, NIC {link.nic_GBps:g} GB/s per GPU, {link.latency_us:g} us a "
        f"transfer ({link.source}); dispatch {inp.dispatch_dtype} rows with ids, combine {inp.combine_dtype}. "
        "crossings: rows per token sent to other nodes (uniform routing with the group limit); node-aware us: "
        "its two legs per phase pipelined over chunks (the slower leg sets the pace)",
        highlight=False,
    )


def print_load_balance(console, balance: planner.LoadBalance) -> None:
    """Max/mean rank load per EP size, redundant count and policy, and the predicted gain on the
    routed experts' time (trivial's max/mean over the policy's)."""
    table = make_table(
        f"Expert load balance, {balance.model}: max/mean rank load",
        [
            ("EP", "right"),
            ("redundant", "right"),
            ("nodes", "right"),
            ("trivial", "right"),
            ("global", "right"),
            ("hierarchical", "right"),
            ("gain global", "right"),
            ("gain hier.", "right"),
        ],
    )

    def cell(value: float | None, suffix: str = "") -> str:
        return "n/a" if value is None else f"{value:.2f}{suffix}"

    for row in balance.rows:
        table.add_row(
            str(row.ep),
            str(row.redundant_per_rank),
            str(row.num_nodes),
            cell(row.trivial),
            cell(row.global_),
            cell(row.hierarchical),
            cell(row.gain_global, "x"),
            cell(row.gain_hierarchical, "x"),
        )
    console.print(table)
    for line in (
        "gain: trivial / policy, the predicted speed-up of the routed experts (all ranks wait for the most",
        "loaded); redundant: extra expert slots per rank; nodes: of 8 GPUs, for hierarchical",
        f"the load: {balance.source}, {balance.num_experts} experts, the hottest "
        f"{balance.expert_max_over_mean:.2f}x the mean",
        *(f"n/a at {note}" for note in balance.notes),
    ):
        console.print(line, markup=False, highlight=False)


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}g}" if abs(value) < 1e6 else f"{value:,.0f}"


def print_plan(console, plan: planner.Plan, calibration: planner.Calibration | None = None, detail: bool = False):
    """The byte model and the overlap verdicts; ``detail``: first the published worked example, the
    verdicts with why, then allgather vs alltoall."""
    if detail:
        print_worked_example(console, plan)
    print_byte_model(console, plan)
    print_verdicts(console, plan, detail)
    if detail:
        print_schemes(console, plan)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
    if calibration is not None:
        console.print(
            f"calibrated: {calibration.GBps:.1f} GB/s, latency {calibration.latency_us:.1f} us ({calibration.method})"
        )


def print_worked_example(console, plan: planner.Plan) -> None:
    """The worked example's six figures, each in its units beside the exact value, and their agreement."""
    inp = plan.inputs
    title = (
        "Published DeepSeek-V3 decode budget, line by line"
        if inp.is_seed_example
        else f"The published budget's convention on your inputs ({inp.model.name})"
    )
    columns = [("figure", "left"), ("formula", "left"), ("published", "right"), ("exact", "right")]
    table = make_table(title, [*columns, ("exact SI", "right"), ("agreement", "right")], wrap=("formula",))
    table.caption = "published, exact: its units, KB = 1024 B, MB = 1000 KB, GB = 1000 MB (its own arithmetic)"
    for fig in plan.seed:
        seed_cell = (
            f"{fig.seed_printed:g} {fig.seed_unit}"
            if fig.seed_printed is not None
            else f"~{fig.seed_rounded:g} {fig.seed_unit}"
        )
        agreement = (
            "—"
            if fig.agreement is None
            else (f"{fig.agreement:+.2%} " + ("ok" if abs(fig.agreement) <= 0.03 else "OFF"))
        )
        table.add_row(
            fig.label,
            fig.formula,
            seed_cell,
            f"{fig.exact_seed_units:.4g} {fig.seed_unit}",
            f"{fig.exact_si:.4g} {fig.si_unit}",
            agreement,
        )
    console.print(table)


def print_byte_model(console, plan: planner.Plan) -> None:
    """What one GPU sends: row sizes, fan-out, bytes per token, a2a, layer and step, the bandwidth."""
    inp, model = plan.inputs, plan.bytes
    fan = model.fanout
    rows = make_table(
        f"Byte model: {inp.model.name}, EP{inp.ep}, batch {inp.batch}, {plan.link.source}",
        [("quantity", "left"), ("value", "right"), ("how", "left")],
        wrap=("how",),
    )
    d, c = model.dispatch_row, model.combine_row
    rows.add_row(
        "dispatch row",
        f"{d.total_B:,} B",
        f"{inp.dispatch_dtype} {d.payload_B} + scales {d.scales_B} + topk ids/weights {d.metadata_B}",
    )
    rows.add_row("combine row", f"{c.total_B:,} B", f"{inp.combine_dtype} {c.payload_B} + scales {c.scales_B}")
    rows.add_row("destination ranks / token", f"{fan.expected_ranks:.3f}", f"max {fan.max_ranks}; {fan.method}")
    rows.add_row(
        "remote ranks / token",
        f"{fan.expected_remote_ranks:.3f}",
        f"x (P-1)/P; {fan.expected_intranode_ranks:.2f} in node, {fan.expected_internode_ranks:.2f} across",
    )
    rows.add_row("bytes per token", f"{model.bytes_per_token_B:,.0f} B", "remote ranks x (dispatch + combine row)")
    rows.add_row(
        "dispatch bytes / a2a",
        f"{model.dispatch_bytes_per_a2a_B / 1e6:.3f} MB",
        f"{model.tokens_per_a2a} tokens (one of {inp.micro_batches} micro-batches)",
    )
    rows.add_row("combine bytes / a2a", f"{model.combine_bytes_per_a2a_B / 1e6:.3f} MB", "")
    rows.add_row("bytes per layer", f"{model.bytes_per_layer_B / 1e6:.3f} MB", f"{inp.batch} tokens")
    rows.add_row("bytes per step", f"{model.bytes_per_step_B / 1e6:.1f} MB", f"{model.layers} MoE layers")
    rows.add_row("required per GPU", f"{model.required_GBps_per_gpu:.2f} GB/s", f"step / TPOT {inp.tpot_ms:g} ms")
    rows.add_row(
        "a2a time, whole batch",
        f"{plan.t_dispatch_us:.1f} / {plan.t_combine_us:.1f} us",
        f"dispatch / combine; latency {plan.link.latency_us:.3g} us + bytes / {plan.link.nvlink_GBps:.4g} GB/s",
    )
    rows.add_row("communication per step", f"{plan.comm_ms_per_step:.2f} ms", "if nothing overlapped")
    console.print(rows)


def print_verdicts(console, plan: planner.Plan, detail: bool) -> None:
    """Per overlap mode: its window, the work to hide in it, what is left; ``detail``: and why."""
    headers = ["mode", "window us", "work us", "left us", "verdict", *(["why"] if detail else [])]
    verdicts = make_table(
        f"Overlap verdicts on {plan.hardware.name} (per layer)",
        [(c, "right" if c.endswith("us") else "left") for c in headers],
        wrap=("why",) if detail else (),
    )
    for v in plan.verdicts:
        verdict = "n/a" if v.fits is None else ("fits" if v.fits else "does not fit")
        why = [v.explanation] if detail else []
        verdicts.add_row(v.mode, _fmt(v.window_us), _fmt(v.work_us), _fmt(v.left_us), verdict, *why)
    console.print(verdicts)
    if not detail:
        for v in plan.verdicts:
            if v.fits is None:
                console.print(f"{v.mode}: {v.explanation}", style="dim", highlight=False)


def print_schemes(console, plan: planner.Plan) -> None:
    """allgather + reduce-scatter against alltoall, per EP size."""
    inp = plan.inputs
    schemes = make_table(
        f"allgather vs alltoall, per GPU per layer, batch {inp.batch}: {plan.schemes.note}",
        [
            (c, "right")
            for c in ("EP", "remote ranks", "allgather MB", "alltoall MB", "ratio", "allgather us", "alltoall us")
        ],
    )
    for r in plan.schemes.rows:
        schemes.add_row(
            str(r.ep),
            f"{r.expected_remote_ranks:.2f}",
            f"{r.allgather_B / 1e6:.2f}",
            f"{r.alltoall_B / 1e6:.2f}",
            f"{r.ratio:.2f}",
            f"{r.allgather_us:.0f}",
            f"{r.alltoall_us:.0f}",
        )
    console.print(schemes)


def print_weight_memory(console, memory: planner.WeightMemory) -> None:
    """The weight-memory table, the model's totals, and what is counted and what is not."""
    gpu_GB = memory.gpu_memory_B / 1e9
    table = make_table(
        f"Weight memory per GPU, {memory.model}: routed experts / EP + other, replicated",
        [
            ("routed experts", "left"),
            ("EP", "right"),
            ("experts/GPU", "right"),
            ("routed GB", "right"),
            ("other GB", "right"),
            ("total GB", "right"),
            (f"fits one H200 ({gpu_GB:g} GB)", "left"),
        ],
    )
    table.caption = "GB = 1e9 B; other = the parts listed below, whole on every GPU"
    for row in memory.rows:
        left_GB = row.left_B / 1e9
        table.add_row(
            row.expert_dtype + (" + scales" if row.expert_dtype == "fp8" else ""),
            str(row.ep),
            str(row.experts_per_gpu),
            f"{row.routed_B / 1e9:.4g}",
            f"{row.other_B / 1e9:.4g}",
            f"{row.total_B / 1e9:.4g}",
            f"yes, {left_GB:.4g} GB left" if row.fits else f"no, {-left_GB:.4g} GB over",
        )
    console.print(table)
    totals = memory.model_total_B
    console.print(
        f"model total, {memory.num_layers} layers ({memory.moe_layers} MoE x {memory.num_experts} routed experts):\n"
        f"  bf16 experts {totals['bf16'] / 1e9:9,.1f} GB = {totals['bf16'] / 1e12:.2f} TB\n"
        f"  fp8 experts  {totals['fp8'] / 1e9:9,.1f} GB = {totals['fp8'] / 1e12:.2f} TB "
        f"({memory.fp8_scales_B / 1e9:.3g} GB of it block scales)",
        markup=False,
    )
    console.print(f"other, per GPU = whole model (shapes: {memory.shapes_source}):", markup=False)
    for part in memory.parts:
        console.print(f"  {part.name} {part.bytes_B / 1e9:.3g} GB: {part.how}", markup=False)
    console.print("not counted:", markup=False)
    for item in memory.not_counted:
        console.print(f"  {item}", markup=False)
    for note in memory.notes:
        console.print(f"note: {note}", markup=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_sbo.cli.plan", description=plan_parser.DESCRIPTION, formatter_class=HelpFormatter
    )
    plan_parser.add_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
