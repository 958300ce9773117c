"""Where SBO and TBO pay at scale: DeepSeek-V3 predicted at EP32..EP256 over nodes of 8 GPUs
(NVLink inside, RDMA between), prefill and decode, every overlap mode and TBO, and the whole step,
beside SGLang's published figures; plus the simulation's JSON.

What is hard is **saying what is a prediction**: every number here comes from ``predict`` on costs
fitted at EP1/EP2 on H200s; SGLang's figures are measurements on other hardware, stood beside them
(``SGLANG``), never fitted to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from ..config import MoEConfig
from ..overlap.sbo import FIXED_MODES
from .inputs import PRESET_SHAPES
from .simulate import Prediction, Setup, dense_layer_us, phase_bytes, predict, remote_nodes_per_token
from .simulate_fit import StageCosts
from .simulate_report import VALIDATION_TOLERANCE, Checked
from .simulate_rows import DispatchPath

# The scale-out setup: DeepSeek-V3 served as SGLang serves it (fp8 experts, fp8 dispatch, DeepEP-style
# transfers), on this project's fused kernels (their measured costs); decode replays CUDA graphs and
# prefill is issued back to back, so neither pays host time.
SCALEOUT_PATH = DispatchPath("low_latency", "triton", "nccl", "fp8", True)
SCALEOUT_KV_LEN = 2048  # cached tokens per decode sequence, as ``bench --tbo`` measures decode
PREFILL_SEQUENCE = 2048  # tokens per prefill sequence (``bench --tbo`` draws 1024-4096)


@dataclass(frozen=True)
class SGLangFigure:
    """A published SGLang measurement the scale-out table stands beside (not a prediction)."""

    regime: str
    tokens_per_gpu: int | None
    feature: str
    change: str
    setting: str


SGLANG = (
    SGLangFigure("prefill", None, "tbo", "+27% to +35% throughput", "EP32, 4 x 8 H100"),
    SGLangFigure("decode", 32, "tbo", "-27% throughput", "32 tokens/GPU"),
    SGLangFigure("decode", 256, "tbo", "+25.5% throughput", "256 tokens/GPU"),
    SGLangFigure("decode", None, "sbo", "+6% throughput", "H20"),
)


@dataclass(frozen=True)
class ScaleRow:
    """DeepSeek-V3 at one EP size and batch: layer times per overlap mode and with TBO, the step."""

    regime: str
    tokens: int
    ep: int
    experts_per_gpu: int
    rdma_nodes_per_token: float
    dispatch_MB: float
    combine_MB: float
    t_modes_us: dict[str, float]
    best_sbo: str
    t_tbo_us: float
    t_tbo_sbo_us: float
    step_ms: dict[str, float]

    @property
    def sbo_gain(self) -> float:
        return self.step_ms["none"] / self.step_ms["sbo"] - 1

    @property
    def tbo_gain(self) -> float:
        return self.step_ms["none"] / self.step_ms["tbo"] - 1

    @property
    def tbo_sbo_gain(self) -> float:
        return self.step_ms["none"] / self.step_ms["tbo+sbo"] - 1


def scaleout_setup(cfg: MoEConfig, ep: int, regime: str, tokens: int) -> Setup:
    if ep < 1 or ep > cfg.num_experts or cfg.num_experts % ep:
        raise ValueError(
            f"--simulate-ep must divide the {cfg.num_experts} routed experts of {cfg.name} (1..{cfg.num_experts}), "
            f"got {ep}; use e.g. 32 64 128"
        )
    if tokens < 1:
        raise ValueError(f"--simulate-prefill and --simulate-decode must be >= 1 token per rank, got {tokens}")
    prefill = regime == "prefill"
    return Setup(
        cfg,
        ep,
        tokens,
        SCALEOUT_PATH,
        wire="cluster",
        graph=True,
        regime=regime,
        sequences=max(1, tokens // PREFILL_SEQUENCE) if prefill else tokens,
        kv_len=0 if prefill else SCALEOUT_KV_LEN,
        expert_dtype="fp8",
        bytes_scheme="node_dedup" if prefill else "per_rank",
        capacity=tokens,
    )


def step_ms(cfg: MoEConfig, cal: StageCosts, setup: Setup, layer_us: float) -> float:
    """A forward of the whole model: its MoE layers at ``layer_us`` plus its dense layers (attention
    and a bf16 MLP of the published FFN width; none counted when the width is unknown)."""
    shapes = PRESET_SHAPES.get(cfg.name)
    dense_inter = shapes.dense_intermediate_size if shapes else None
    dense = dense_layer_us(cfg, cal, setup.tokens, dense_inter, setup) if dense_inter else 0.0
    return (cfg.num_moe_layers * layer_us + cfg.first_k_dense_replace * dense) / 1e3


def scaleout(
    cal: StageCosts, cfg: MoEConfig, eps: Sequence[int], prefill: Sequence[int], decode: Sequence[int]
) -> list[ScaleRow]:
    rows = []
    for regime, sizes in (("prefill", prefill), ("decode", decode)):
        for tokens in sizes:
            for ep in eps:
                base = scaleout_setup(cfg, ep, regime, tokens)
                modes = {m: predict(replace(base, overlap=m), cal).t_layer_us for m in FIXED_MODES}
                best = min(modes, key=lambda m: modes[m])
                tbo = predict(replace(base, tbo=True), cal).t_layer_us
                tbo_sbo = min(predict(replace(base, tbo=True, overlap=m), cal).t_layer_us for m in FIXED_MODES)
                (d_in, d_out), (c_in, c_out) = phase_bytes(base, tokens)
                steps = {
                    "none": step_ms(cfg, cal, base, modes["none"]),
                    "sbo": step_ms(cfg, cal, base, modes[best]),
                    "tbo": step_ms(cfg, cal, base, tbo),
                    "tbo+sbo": step_ms(cfg, cal, base, tbo_sbo),
                }
                rows.append(
                    ScaleRow(
                        regime,
                        tokens,
                        ep,
                        base.experts_per_gpu,
                        remote_nodes_per_token(cfg, ep, base.gpus_per_node),
                        (d_in + d_out) / 1e6,
                        (c_in + c_out) / 1e6,
                        modes,
                        best,
                        tbo,
                        tbo_sbo,
                        steps,
                    )
                )
    return rows


def sglang_beside(row: ScaleRow) -> str:
    """SGLang's published figures for this regime and batch, as one line (not a prediction)."""
    figures = [f for f in SGLANG if f.regime == row.regime and f.tokens_per_gpu in (None, row.tokens)]
    return "; ".join(f"{f.feature.upper()} {f.change} ({f.setting})" for f in figures)


def timeline_cases(cal: StageCosts, base: Setup) -> dict[str, Prediction]:
    """One predicted layer four ways, for the timeline picture: no overlap, the best SBO mode, TBO,
    TBO with the best SBO mode."""
    modes = {m: predict(replace(base, overlap=m), cal) for m in FIXED_MODES}
    best = min(modes.values(), key=lambda p: p.t_layer_us)
    tbo = predict(replace(base, tbo=True), cal)
    tbo_sbo = min((predict(replace(base, tbo=True, overlap=m), cal) for m in FIXED_MODES), key=lambda p: p.t_layer_us)
    return {
        f"no overlap: {modes['none'].t_layer_us:.0f} us": modes["none"],
        f"SBO {best.overlap}: {best.t_layer_us:.0f} us": best,
        f"TBO: {tbo.t_layer_us:.0f} us": tbo,
        f"TBO + SBO {tbo_sbo.overlap}: {tbo_sbo.t_layer_us:.0f} us": tbo_sbo,
    }


def simulation_to_json(cal: StageCosts, checked: Sequence[Checked], scale: Sequence[ScaleRow]) -> dict:
    return {
        "calibration": {
            "files": list(cal.files),
            "gemm": {d: asdict(f) for d, f in cal.gemm.items()},
            "grouped_mm_weight_GBps": None
            if cal.grouped_mm is None
            else {f"{2**x:.0f}": rate for x, rate in cal.grouped_mm.knots},  # by experts with rows
            "links": {w: asdict(f) for w, f in cal.links.items()},
            "contention": asdict(cal.contention),
            "attention_us": cal.attention_us,
        },
        "validation": [
            {**asdict(c), "error": c.error, "within_tolerance": c.within, "tolerance": VALIDATION_TOLERANCE}
            for c in checked
        ],
        "scaleout": [
            {
                **asdict(r),
                "sbo_gain": r.sbo_gain,
                "tbo_gain": r.tbo_gain,
                "tbo_sbo_gain": r.tbo_sbo_gain,
                "sglang": sglang_beside(r),
            }
            for r in scale
        ],
        "sglang": [asdict(f) for f in SGLANG],
    }
