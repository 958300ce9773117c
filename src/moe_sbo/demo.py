"""``moe-sbo demo``: every dispatcher against the single-rank reference, on N local ranks.

Each rank builds the reference layer (``local``: all experts, same seed, so the same weights) and one
layer per dispatcher, runs its own random tokens through both, and reports the error, the bytes it
moved and the time of each phase. Phase times come from hooks on the dispatcher: the demo measures
itself with the same mechanism overlap strategies use, without touching the layer.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .checkpoint import Checkpoint, LayerLoader
from .config import get_preset
from .attention import AttentionConfig, Batch
from .decoder import DecoderLayer
from .dispatch import options_for_tokens
from .layer import MoELayer
from .overlap.tbo import tbo_forward

# Relative L2 error allowed against the reference, per dtype: float32 differs only by summation
# order; bf16 by rounding of the activations that cross the wire and of the GEMM outputs.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class DemoRow:
    dispatcher: str
    overlap: str
    tbo: bool
    same_as_none: bool  # bitwise equal to this dispatcher's output with the first overlap mode ("none")
    rank: int
    tokens: int
    max_abs_err: float
    rel_err: float
    ok: bool
    bytes_sent: int
    bytes_recv: int
    t_route_us: float
    t_dispatch_us: float
    t_experts_us: float
    t_combine_us: float
    t_layer_us: float


class PhaseClock:
    """Hooks that timestamp the four phase boundaries (synchronising CUDA so times are real)."""

    def __init__(self, layer: MoELayer):
        self.stamps: dict[str, float] = {}
        self._cuda = layer.router.weight.is_cuda
        for event in ("pre_dispatch", "post_dispatch", "pre_combine", "post_combine"):
            layer.dispatcher.hooks.register(event, self._stamper(event))

    def now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _stamper(self, event: str):
        def stamp(dispatcher, payload):
            self.stamps[event] = self.now()
        return stamp


def run_demo_rank(device: torch.device, preset: str, dispatchers: list[str], tokens: int, seed: int,
                  dtype_name: str, iters: int, overlaps: tuple[str, ...] = ("none",), *,
                  checkpoint: str | None = None, layer_index: int | None = None, tbo: bool = False) -> list[dict]:
    """One rank's share of the demo (called on every rank by ``LocalRanks.run``): one row per
    dispatcher and overlap mode. With ``checkpoint`` (a model directory) the model and weights are
    MoE layer ``layer_index`` of it instead of ``preset`` and ``seed``: each dispatcher's layer reads only
    this rank's experts; the ``local`` reference reads them all. With ``tbo`` each MoE layer sits in a
    decoder layer (attention + MoE) run with two-batch overlap on packed sequences, against the
    ``local`` decoder layer without it; phase times are then micro-batch A's."""
    load = LayerLoader(Checkpoint(checkpoint), layer_index) if checkpoint else (lambda moe: moe)
    cfg = load.checkpoint.moe_config if checkpoint else get_preset(preset)
    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    x_TH = torch.randn(tokens, cfg.hidden_size, generator=generator, device=device).to(dtype)
    model, run, run_reference = _models(tbo, tokens, cfg.hidden_size, seed, device)
    with torch.inference_mode():
        reference_TH = run_reference(model(load(MoELayer(cfg, dispatcher="local", dtype=dtype, device=device,
                                                         seed=seed))), x_TH)
        rows = []
        for name, overlap in itertools.product(dispatchers, overlaps):
            layer = load(MoELayer(cfg, dispatcher=name, dtype=dtype, device=device, seed=seed, overlap=overlap,
                                  dispatcher_options=options_for_tokens(name, tokens)))
            clock = PhaseClock(layer)
            wrapped = model(layer)
            samples = []
            for _ in range(iters + 1):  # the first forward warms up and is not timed
                start = clock.now()
                y_TH = run(wrapped, x_TH)
                end = clock.now()
                s = clock.stamps
                samples.append((s["pre_dispatch"] - start, s["post_dispatch"] - s["pre_dispatch"],
                                s["pre_combine"] - s["post_dispatch"], s["post_combine"] - s["pre_combine"],
                                end - start))
            medians = [statistics.median(col) * 1e6 for col in zip(*samples[1:])]
            if overlap == overlaps[0]:
                first_mode_y_TH = y_TH
            diff = (y_TH.float() - reference_TH.float())
            ref_norm = reference_TH.float().norm().item()
            rel = diff.norm().item() / ref_norm if ref_norm > 0 else diff.norm().item()
            traffic = layer.last_traffic
            rows.append(asdict(DemoRow(
                dispatcher=name, overlap=overlap, tbo=tbo, same_as_none=torch.equal(y_TH, first_mode_y_TH),
                rank=rank, tokens=tokens,
                max_abs_err=diff.abs().max().item() if diff.numel() else 0.0, rel_err=rel,
                ok=rel <= TOLERANCE[dtype], bytes_sent=traffic.bytes_sent, bytes_recv=traffic.bytes_recv,
                t_route_us=medians[0], t_dispatch_us=medians[1], t_experts_us=medians[2],
                t_combine_us=medians[3], t_layer_us=medians[4],
            )))
    return rows


def _models(tbo: bool, tokens: int, hidden_size: int, seed: int, device: torch.device):
    """(wrap a MoE layer, run it, run the reference): the MoE layer alone, or with ``tbo`` a decoder
    layer on packed sequences of up to 48 tokens, run with two-batch overlap (reference: without)."""
    if not tbo:
        return (lambda moe: moe), (lambda layer, x: layer(x)), (lambda layer, x: layer(x))
    head_dim = 16 if hidden_size < 1024 else 128
    heads = hidden_size // head_dim
    attn = AttentionConfig(hidden_size, heads, max(1, heads // 4), head_dim)
    lengths = [min(48, tokens - start) for start in range(0, tokens, 48)]
    batch = Batch.prefill(lengths, device=device)

    def cache(layer):
        return layer.make_cache(max(1, len(lengths)), 48)

    return ((lambda moe: DecoderLayer(attn, moe, seed=seed)),
            (lambda layer, x: tbo_forward(layer, x, batch, cache(layer))),
            (lambda layer, x: layer(x, batch, cache(layer))))


def summarise(per_rank: list[list[dict]]) -> list[dict]:
    """One row per dispatcher: worst error over ranks, mean bytes per rank, slowest rank's times."""
    summary = []
    for rows in zip(*per_rank):
        first = rows[0]
        summary.append({
            "bench": "demo", "dispatcher": first["dispatcher"], "overlap": first["overlap"], "tbo": first["tbo"],
            "same_as_none": all(r["same_as_none"] for r in rows), "ranks": len(rows),
            "tokens_per_rank": first["tokens"],
            "max_abs_err": max(r["max_abs_err"] for r in rows),
            "rel_err": max(r["rel_err"] for r in rows),
            "ok": all(r["ok"] for r in rows),
            "bytes_sent": round(statistics.mean(r["bytes_sent"] for r in rows)),
            "bytes_recv": round(statistics.mean(r["bytes_recv"] for r in rows)),
            **{key: max(r[key] for r in rows) for key in
               ("t_route_us", "t_dispatch_us", "t_experts_us", "t_combine_us", "t_layer_us")},
        })
    return summary
