"""``moe-sbo check``: one MoE layer of a real checkpoint, every dispatcher, against ``transformers``.

Each rank reads only its own experts of layer N from the checkpoint (``hf/checkpoint.py``), builds one
layer per dispatcher and runs its own random tokens through them. The parent process builds
``transformers``' own MoE block for the model (``hf.reference.reference_moe_block``) on the whole layer, read
from the same files, and runs the same tokens through it. Tolerance, relative L2 error
‖y − ref‖ / ‖ref‖ per rank: 1e-5 with ``--dtype float32`` (only summation order differs),
2e-2 with ``--dtype bfloat16`` (activations and weights rounded; the reference stays float32),
6e-2 with ``--expert-dtype fp8`` (whatever ``--dtype``). FP8 experts hold e4m3 weights with 128x128
block scales (as stored, or quantised on load); the reference runs on those weights dequantised, so
what differs is the experts' two activation quantisations (e4m3, one scale per token and 128 values,
~2.6% RMS each): about 4% on the routed output. Exit code 0 only if every dispatcher on every rank
is within it.

The hard part is failing early: config.json, the layer index, the EP size and every tensor name,
shape and FP8 scale of the layer (from the safetensors headers, no data) are checked in the parent
before any rank starts, so a broken checkpoint gives one clear error, not a rank stuck in a collective.
The reference holds the whole layer in float32 in the parent (DeepSeek-V3: about 45 GB).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util

import torch
import torch.distributed as dist
from rich.markup import escape

from ..dispatch import DISPATCHERS
from ..hf.checkpoint import Checkpoint, LayerLoader
from ..layer import MoELayer
from ..measure.memory import check_memory, estimate_rank_bytes, memory_fix
from ..measure.options import compact, make_table, print_notes, resolve_expert_dtype, sci
from ..measure.progress import rank_progress
from ..measure.results import result_meta
from ..measure.run import prepare, write_json
from ..quant.fp8 import dequantize_fp8_blocks
from ..weights import MoEWeights

# Relative L2 error allowed against transformers' float32 module, per --dtype.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
# With --expert-dtype fp8, whatever --dtype: the reference has the same (dequantised) weights, but
# each of the expert MLP's two activation quantisations (e4m3, one scale per token and 128 values)
# rounds by ~2.6% RMS, so the routed output differs by ~4%; 6e-2 leaves room for bf16 on top.
FP8_TOLERANCE = 6e-2
FP8_NOTE = (
    "fp8 experts: the reference runs on the dequantised e4m3 weights; the experts' two e4m3 activation "
    "quantisations (~2.6% RMS each) leave ~4% relative error"
)


def check_dispatchers(choice: str, ranks: int) -> list[str]:
    """``--dispatcher`` -> names. ``all`` leaves out ``local`` on several ranks: it would make every
    rank read every expert, which is what the per-rank read exists to avoid."""
    if choice == "all":
        return ["local"] if ranks == 1 else [name for name in sorted(DISPATCHERS) if name != "local"]
    if choice not in DISPATCHERS:
        raise ValueError(f"--dispatcher must be one of {sorted(DISPATCHERS)} or all, got {choice!r}")
    return [choice]


def check_inputs(seed: int, ranks: int, tokens: int, hidden_size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each rank's tokens ``[T, H]``: random, already rounded to ``dtype`` so the float32 reference
    sees exactly the values our layer sees (routing ties cannot flip on input rounding)."""
    inputs = []
    for rank in range(ranks):
        generator = torch.Generator().manual_seed(seed * 7919 + rank)
        inputs.append(torch.randn(tokens, hidden_size, generator=generator).to(dtype))
    return inputs


def run_check(args: argparse.Namespace) -> int:
    """Run the check; print the table; write ``--json``. Returns 0 (all within tolerance) or 1."""
    run, (json_path,) = prepare(args.device, args.ranks, ("--json", args.json))
    device, ranks, console = run.device, run.count, run.console
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    names = check_dispatchers(args.dispatcher, ranks)
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("moe-sbo check compares with transformers' own module; pip install 'moe-sbo[hf]'")
    checkpoint = Checkpoint(args.checkpoint)
    layer = checkpoint.validate_layer(args.layer)  # the index, then every name, shape, FP8 scale (headers only)
    cfg = checkpoint.moe_config
    cfg.experts_per_rank(ranks)  # raises before any rank starts if they do not divide
    expert_dtype = resolve_expert_dtype(args.expert_dtype, cfg)  # sizes checked before any rank starts
    dtype = getattr(torch, args.dtype)
    inputs = check_inputs(args.seed, ranks, args.tokens, cfg.hidden_size, dtype)
    tolerance = check_tolerance(args.dtype, expert_dtype)
    # Each rank holds one layer per dispatcher; the reference (every expert) is built here, beside them.
    estimate = estimate_rank_bytes(
        cfg,
        ranks,
        args.dtype,
        args.tokens,
        layers=len(names),
        reference=True,
        layers_are="copies of the layer, one per dispatcher,",
    )
    memory = check_memory(estimate, device, ranks, fix=memory_fix(device, "one --dispatcher or fewer --tokens"))

    console.print(
        f"[bold]moe-sbo check[/]: {escape(str(checkpoint.path))} ({checkpoint.model_type}), layer {layer}",
        soft_wrap=True,  # the path is printed whole
    )
    experts = "fp8 (e4m3, 128x128 block scales)" if expert_dtype else args.dtype
    console.print(
        f"  {cfg.num_experts} experts on {ranks} {device} ranks, {args.tokens} tokens/rank, {args.dtype}, "
        f"routed experts {experts}"
    )
    console.print(memory, highlight=False)
    per_rank = run.run(check_rank, str(checkpoint.path), layer, names, inputs, args.dtype, expert_dtype=expert_dtype)
    references = reference_outputs(checkpoint, layer, inputs, fp8_experts=expert_dtype == "fp8")
    rows = compare(per_rank, references, names, tolerance, args.tokens)

    for rank, result in enumerate(per_rank):
        for read in result["reads"]:
            console.print(
                f"rank {rank} read experts {read['experts'][0]}..{read['experts'][1] - 1}: "
                f"{read['tensors']} tensors, {read['bytes_read']:,} B from {len(read['files'])} "
                f"of {len(set(checkpoint.weight_map.values()))} files"
            )
    console.print(check_table(rows, tolerance))
    print_notes(
        console,
        f"ok: rel L2 error <= {tolerance:g} on every rank",
        "read: most bytes a rank read; sent: mean bytes sent per rank",
        FP8_NOTE if expert_dtype else None,
    )
    if json_path:
        meta = {
            **result_meta(device=device, world_size=ranks),
            "checkpoint": str(checkpoint.path),
            "layer": layer,
            "expert_dtype": expert_dtype or args.dtype,
        }
        write_json(json_path, {"meta": meta, "rows": rows}, console, f"rows written to {json_path}")
    console.print(verdict(rows, tolerance), highlight=False, soft_wrap=True)  # one line, for scripts
    return 0 if all(r["ok"] for r in rows) else 1


def check_tolerance(dtype_name: str, expert_dtype: str | None) -> float:
    """The relative L2 error allowed against the reference: ``FP8_TOLERANCE`` for FP8 experts, else
    ``TOLERANCE`` of ``--dtype``."""
    return FP8_TOLERANCE if expert_dtype == "fp8" else TOLERANCE[dtype_name]


def check_table(rows: list[dict], tolerance: float):
    """``compare``'s rows as a table that fits 100 columns."""
    columns = [("dispatcher", "left"), ("|err| max/rel", "right"), ("ok", "left")]
    columns += [("read B/rank", "right"), ("sent B/rank", "right")]
    table = make_table(f"each dispatcher vs transformers' module (rel L2 tolerance {tolerance:g})", columns)
    for r in rows:
        table.add_row(
            r["dispatcher"],
            f"{sci(r['max_abs_err'])}/{sci(r['rel_err'])}",
            "[green]yes[/]" if r["ok"] else "[red]NO[/]",
            compact(r["bytes_read"]),
            compact(r["bytes_sent"]),
        )
    return table


def verdict(rows: list[dict], tolerance: float) -> str:
    """The closing line: how many dispatchers match transformers, and which do not."""
    ok = [r["dispatcher"] for r in rows if r["ok"]]
    line = f"{len(ok)}/{len(rows)} dispatchers match transformers' module on every rank (rel L2 <= {tolerance:g})"
    failed = [r["dispatcher"] for r in rows if not r["ok"]]
    return line + (f"; beyond tolerance: {', '.join(failed)}" if failed else "")


def check_rank(
    device: torch.device,
    path: str,
    layer_index: int,
    dispatchers: list[str],
    inputs: list[torch.Tensor],
    dtype_name: str,
    expert_dtype: str | None = None,
) -> dict:
    """One rank's share (called on every rank by ``LocalRanks.run``): read this rank's experts, build
    one layer per dispatcher (routed experts in ``expert_dtype``, as ``MoELayer`` takes it), run this
    rank's tokens through each.

    Returns ``{"outputs": {dispatcher: y [T, H] float32 CPU}, "traffic": {dispatcher: (sent, recv)},
    "bytes_read": {dispatcher: int}, "reads": [ReadReport.as_dict()]}``. Every read happens before
    the first forward, so a checkpoint error raises before any collective.
    """
    load = LayerLoader(Checkpoint(path), layer_index)
    dtype = getattr(torch, dtype_name)
    cfg = load.checkpoint.moe_config
    layers = [
        load(MoELayer(cfg, dispatcher=name, dtype=dtype, device=device, expert_dtype=expert_dtype))
        for name in dispatchers
    ]
    rank = dist.get_rank() if dist.is_initialized() else 0
    x_TH = inputs[rank].to(device)
    outputs, traffic, bytes_read = {}, {}, {}
    progress = rank_progress(rank, len(dispatchers), "check")
    with torch.inference_mode():
        for name, layer in zip(dispatchers, layers):
            outputs[name] = layer(x_TH).float().cpu()
            if progress:
                progress(name)
            traffic[name] = (layer.last_traffic.bytes_sent, layer.last_traffic.bytes_recv)
            bytes_read[name] = load.report(layer).bytes_read
    return {
        "outputs": outputs,
        "traffic": traffic,
        "bytes_read": bytes_read,
        "reads": [report.as_dict() for report in load.reports],
    }


@torch.no_grad()
def reference_outputs(
    checkpoint: Checkpoint, layer: int, inputs: list[torch.Tensor], fp8_experts: bool = False
) -> list[torch.Tensor]:
    """``transformers``' block for the model, every expert of ``layer`` in float32, on each rank's tokens.

    ``fp8_experts``: the routed experts are read as FP8 layers hold them (e4m3, 128x128 block scales:
    as stored, or quantised) and dequantised, so the reference has exactly the weights our layers
    compute with, and the comparison measures the FP8 experts' activation rounding alone.
    """
    from ..hf.reference import reference_moe_block

    weights, _ = checkpoint.read_moe_weights(layer, dtype=torch.float32, fp8_experts=fp8_experts)
    block = reference_moe_block(checkpoint.hf_config, dequantized_experts(weights) if fp8_experts else weights)
    return [block(x_TH.float()[None])[0] for x_TH in inputs]


def dequantized_experts(weights: MoEWeights) -> MoEWeights:
    """``weights`` with its FP8 routed experts dequantised to float32, one expert at a time (so the
    block scales are expanded for one matrix, never for all experts at once)."""
    scales = {"gate_up_proj_E2IH": weights.gate_up_proj_scale_inv, "down_proj_EHI": weights.down_proj_scale_inv}
    dense = {}
    for name, scale_inv in scales.items():
        if scale_inv is None:
            raise ValueError(f"{name} must come with its block scales to be dequantised, got none")
        fp8_weight = getattr(weights, name)
        dense[name] = torch.empty(fp8_weight.shape, dtype=torch.float32)
        for expert in range(fp8_weight.shape[0]):
            dense[name][expert] = dequantize_fp8_blocks(fp8_weight[expert], scale_inv[expert])
    return dataclasses.replace(weights, **dense, gate_up_proj_scale_inv=None, down_proj_scale_inv=None)


def compare(
    per_rank: list[dict], references: list[torch.Tensor], dispatchers: list[str], tolerance: float, tokens: int
) -> list[dict]:
    """One row per dispatcher: worst error over ranks, most bytes read and mean bytes moved per rank."""
    rows = []
    for name in dispatchers:
        max_abs, rel = 0.0, 0.0
        for result, ref_TH in zip(per_rank, references):
            diff_TH = result["outputs"][name] - ref_TH
            max_abs = max(max_abs, diff_TH.abs().max().item())
            rel = max(rel, (diff_TH.norm() / ref_TH.norm().clamp_min(1e-30)).item())
        rows.append(
            {
                "bench": "check",
                "dispatcher": name,
                "ranks": len(per_rank),
                "tokens_per_rank": tokens,
                "max_abs_err": max_abs,
                "rel_err": rel,
                "tolerance": tolerance,
                "ok": rel <= tolerance,
                "bytes_read": max(r["bytes_read"][name] for r in per_rank),
                "bytes_sent": round(sum(r["traffic"][name][0] for r in per_rank) / len(per_rank)),
                "bytes_recv": round(sum(r["traffic"][name][1] for r in per_rank) / len(per_rank)),
            }
        )
    return rows
