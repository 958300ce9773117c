"""``moe-sbo demo --elastic``: one rank is killed mid-run and the others recover.

Every rank runs three forwards of an elastic layer (``launch/elastic_layer.py``) over the dispatcher; the
victim dies (SIGKILL) at ``--at`` of the second (or between the first two). The survivors agree on
the loss, re-form without it, re-run the forward in flight degraded, restore the lost experts from
the seeded weights (the stand-in for a checkpoint: each expert read alone) and run the third
forward. Each forward is compared with a single-rank layer: the full one, or for the degraded re-run
the same layer with the lost experts masked. The hard part is only the bookkeeping: a survivor that
had finished the forward in flight recovers in the next one, which is exact.
"""

from __future__ import annotations

import argparse
import os
import signal
from dataclasses import asdict
from typing import Any

import torch
from rich.console import Console

from ..config import PRESETS, get_preset
from ..dispatch import options_for_tokens
from ..eplb.runtime import EPLBOptions
from ..launch import elastic
from ..launch.elastic import ElasticMoE, ElasticOptions
from ..launch.failures import RankFailure
from ..launch.ranks import LocalRanks
from ..layer import MoELayer
from ..measure.options import make_table, print_notes, sci
from ..measure.results import result_meta
from ..measure.run import write_json
from ..weights import seeded_expert

FORWARDS = 3  # the victim dies in forward 1; forward 2 runs after the restore
TOLERANCE = 1e-5  # relative max error, float32 (summation order only)


def spare_slots_needed(num_experts: int, ranks: int) -> int:
    """The fewest spare slots per rank with which ``ranks - 1`` survivors hold every expert again."""
    per_rank = num_experts // ranks
    spare = 0
    while (ranks - 1) * (per_rank + spare) < num_experts:
        spare += 1
    return spare


def run_elastic_rank(device, preset: str, dispatcher: str, tokens: int, seed: int, victim: int, at: str) -> dict:
    """Three forwards of an elastic layer on this rank; the victim dies at ``at`` of forward 1."""
    group = elastic.session()
    cfg = get_preset(preset)
    options: dict[str, Any] | None = dict(options_for_tokens(dispatcher, tokens)) or None
    if dispatcher == "low_latency":  # a transport whose wait raises on a lost peer (elastic_layer.check_transport)
        options = {**(options or {}), "transport": "nccl"}
    layer = MoELayer(cfg, dispatcher=dispatcher, seed=seed, eplb=group.options.eplb(), dispatcher_options=options)
    el = ElasticMoE(layer, group, lambda expert: seeded_expert(cfg, seed, expert, device))
    me, forward = group.member, {"n": 0}
    if me == victim and at != "between_forwards":

        def die(dispatcher, payload):
            if forward["n"] == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        layer.dispatcher.hooks.register(at, die)
    rows = []
    with torch.inference_mode():
        for n in range(FORWARDS):
            forward["n"] = n
            if me == victim and at == "between_forwards" and n == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            generator = torch.Generator().manual_seed(seed + 1000 * n + me)
            x = torch.randn(tokens, cfg.hidden_size, generator=generator, device=device)
            before = len(group.recoveries)
            y = el(x)
            recovery = group.recoveries[-1] if len(group.recoveries) > before else None
            masked = recovery.missing_experts if recovery is not None and recovery.reran else ()
            reference = MoELayer(cfg, dispatcher="local", seed=seed, eplb=EPLBOptions(), device=device)
            reference.replicas.mask(masked)
            expected = reference(x)
            err = float((y - expected).abs().max() / expected.abs().max().clamp(min=1e-12))
            rows.append({"forward": n, "ranks": group.size, "masked": list(masked), "rel_err": err})
    return {"member": me, "rows": rows, "recoveries": [asdict(r) for r in group.recoveries]}


def check_elastic(args: argparse.Namespace, ranks: int, names: list[str]) -> int:
    """``--elastic``'s combinations, refused before any rank starts; returns the victim."""
    if ranks < 2:
        raise ValueError(f"--elastic loses a rank and needs the others, got --ranks {ranks}; use --ranks 4")
    for flag, given in (("--tbo", args.tbo), ("--eplb", args.eplb), ("--checkpoint", args.checkpoint)):
        if given:
            raise ValueError(
                f"--elastic runs --preset's seeded weights with its own spare slots, got {flag}; leave one out"
            )
    if "local" in names and args.dispatcher == "local":
        raise ValueError("--elastic needs a dispatcher over several ranks, got --dispatcher local")
    victim = ranks - 1 if args.kill_rank is None else args.kill_rank
    if not 0 <= victim < ranks:
        raise ValueError(f"--kill-rank must be a rank in [0, {ranks}), got {args.kill_rank}")
    if args.dtype not in (None, "float32") or args.expert_dtype:
        raise ValueError("--elastic compares float32 outputs with the reference; leave out --dtype and --expert-dtype")
    return victim


def run_elastic_demo(
    args: argparse.Namespace, device: str, ranks: int, names: list[str], console: Console, json_path
) -> int:
    victim = check_elastic(args, ranks, names)
    names = [n for n in names if n != "local"]
    model = PRESETS[args.preset]
    model.experts_per_rank(ranks)
    spare = spare_slots_needed(model.num_experts, ranks)
    policy = ElasticOptions(spare_slots_per_rank=spare, dead_after_s=2.0)
    console.print(
        f"[bold]moe-sbo demo --elastic[/]: preset {args.preset}, {ranks} {device} ranks, {args.tokens} tokens/rank, "
        "float32",
        highlight=False,
    )
    console.print(
        f"  rank {victim} killed {_where(args.at)} (of {FORWARDS}); {spare} spare expert slot(s) per rank",
        highlight=False,
    )
    rows = []
    for name in names:
        with LocalRanks(ranks, device=device, elastic=policy) as workers:
            answers = workers.run(run_elastic_rank, args.preset, name, args.tokens, args.seed, victim, args.at)
        rows.append(_summarise(name, answers, victim, args.at))
    console.print(_forwards_table(rows))
    print_notes(
        console,
        "each survivor's forwards vs a single-rank layer: the full one, or with the lost experts masked "
        "(degraded) for a re-run (a rank that had finished the forward in flight kept its full output); ranks: "
        f"the group each forward ran in; ok: relative max error <= {TOLERANCE:g} on every survivor",
    )
    console.print(_recovery_table(rows))
    print_notes(
        console,
        "ms: the slowest survivor; detect: its failed collective to the agreed lost set; re-form: the new group "
        "and layers; re-run: the forward in flight; restore: the lost experts read into spare slots from the "
        "seeded weights (a checkpoint's stand-in); degraded tok: the re-run's tokens that lost an expert",
    )
    if json_path:
        meta = {**result_meta(device=device, world_size=ranks), "elastic": True}
        write_json(json_path, {"meta": meta, "rows": rows}, console, f"rows written to {json_path}")
    good = sum(r["ok"] for r in rows)
    console.print(  # one line, for scripts
        f"verdict: {'OK' if good == len(rows) else 'FAILED'}: rank {victim} lost at {args.at}; {good}/{len(rows)} "
        "dispatchers recovered and matched the reference",
        highlight=False,
        soft_wrap=True,
    )
    ok = good == len(rows)
    return 0 if ok else 1


def _experts(count: int) -> str:
    return f"{count} expert" + ("" if count == 1 else "s")


def _where(at: str) -> str:
    return "between forwards 0 and 1" if at == "between_forwards" else f"at {at} of forward 1"


def _summarise(name: str, answers: list, victim: int, at: str) -> dict:
    survivors = [a for i, a in enumerate(answers) if i != victim]
    failed = [a for a in survivors if isinstance(a, RankFailure)]
    died = isinstance(answers[victim], RankFailure) and answers[victim].kind == "died"
    good = [a for a in survivors if not isinstance(a, RankFailure)]
    recoveries = [a["recoveries"][0] for a in good if len(a["recoveries"]) == 1]
    agreed = len({(tuple(r["lost"]), tuple(r["members"])) for r in recoveries}) == 1
    worst = max((row["rel_err"] for a in good for row in a["rows"]), default=float("inf"))
    first = recoveries[0] if recoveries else {}
    return {
        "bench": "elastic",
        "dispatcher": name,
        "ep": len(answers),
        "lost_rank": victim,
        "at_event": at,
        "survivors": len(good),
        "failed": [f.cause for f in failed],
        "agreed": agreed and len(recoveries) == len(survivors),
        "lost": first.get("lost"),
        "t_detect_ms": max((r["t_detect_ms"] for r in recoveries), default=None),
        "t_reform_ms": max((r["t_reform_ms"] for r in recoveries), default=None),
        "t_rerun_ms": max((r["t_rerun_ms"] for r in recoveries), default=None),
        "t_restore_ms": max((r["t_restore_ms"] for r in recoveries), default=None),
        "degraded_tokens": sum(r["degraded_tokens"] for r in recoveries),
        "missing_experts": first.get("missing_experts"),
        "restored_from": first.get("restored_from"),
        "forwards": [[row for row in a["rows"]] for a in good],
        "max_rel_err": worst,
        "ok": died and not failed and agreed and len(recoveries) == len(survivors) and worst <= TOLERANCE,
    }


def _forwards_table(rows: list[dict]):
    columns = [("dispatcher", "left"), ("forward", "right"), ("ranks", "right"), ("reference", "left")]
    columns += [("rel err (max)", "right"), ("ok", "left")]
    table = make_table("the survivors' forwards", columns)
    for r in rows:
        for n in range(len(r["forwards"][0]) if r["forwards"] else 0):
            per_rank = [forwards[n] for forwards in r["forwards"]]
            masked = sorted({e for row in per_rank for e in row["masked"]})
            err = max(row["rel_err"] for row in per_rank)
            reference = f"masked {masked}" if masked else "full layer"
            if masked and any(not row["masked"] for row in per_rank):
                reference = f"masked {masked} / full"  # ranks that had finished it before the loss: full
            sizes = sorted({row["ranks"] for row in per_rank})
            table.add_row(
                r["dispatcher"],
                str(n),
                "/".join(map(str, sizes)),
                reference,
                sci(err),
                "[green]yes[/]" if err <= TOLERANCE else "[red]NO[/]",
            )
    return table


def _recovery_table(rows: list[dict]):
    columns = [("dispatcher", "left"), ("lost", "left"), ("agreed", "left")]
    columns += [(name, "right") for name in ("detect ms", "re-form ms", "re-run ms", "restore ms")]
    columns += [("degraded tok", "right"), ("restored", "left")]
    table = make_table("the recovery (ms: the slowest survivor)", columns)
    for r in rows:
        times = [r[k] for k in ("t_detect_ms", "t_reform_ms", "t_rerun_ms", "t_restore_ms")]
        table.add_row(
            r["dispatcher"],
            str(list(r["lost"] or ())),
            "[green]yes[/]" if r["agreed"] else "[red]NO[/]",
            *("-" if t is None else f"{t:.1f}" for t in times),
            str(r["degraded_tokens"]),
            f"{r['restored_from']} ({_experts(len(r['missing_experts'] or ()))})",
        )
    return table
