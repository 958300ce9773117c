"""The communication-budget planner: the seed's figures, hand-worked cases, properties, bad input, CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    import moe_sbo  # noqa: F401
except ModuleNotFoundError:  # package not installed yet: run from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from moe_sbo import planner
from moe_sbo.cli.plan import main as plan_main
from moe_sbo.config import PRESETS, MoEConfig, divisors


def seed_inputs(**changes) -> planner.PlanInputs:
    return planner.PlanInputs(model=PRESETS["deepseek-v3"], **changes)


# ---------------------------------------------------------------------------------------- seed figures


def test_seed_figures_agree_within_three_percent():
    figures = {f.key: f for f in planner.seed_figures(seed_inputs())}
    assert set(figures) == set(planner.SEED_PRINTED)
    for fig in figures.values():
        assert fig.seed_printed is not None
        assert abs(fig.agreement) <= 0.03, fig


def test_seed_figures_exact_values_by_hand():
    figures = {f.key: f for f in planner.seed_figures(seed_inputs())}
    assert figures["bytes_per_token"].exact == 7168  # hidden_size FP8 bytes = 7 x 1024
    assert figures["bytes_per_a2a"].exact == 256 * 7168 == 1_835_008
    assert figures["bytes_per_layer"].exact == 2 * 1_835_008
    assert figures["bytes_per_step"].exact == 61 * 2 * 1_835_008 == 223_870_976
    assert figures["required_GBps_per_gpu"].exact == pytest.approx(223_870_976 * 50)
    assert figures["a2a_budget_us"].exact == (320 - 120) / 2 == 100
    # The seed's units: 1792 KB written as "1.78 MB" (MB = 1000 KB), 218.6 "MB" -> "218 MB".
    assert figures["bytes_per_a2a"].exact_seed_units == pytest.approx(1.792)
    assert figures["bytes_per_step"].exact_seed_units == pytest.approx(218.624)
    assert figures["required_GBps_per_gpu"].exact_seed_units == pytest.approx(10.9312)


def test_seed_printed_only_for_the_seed_inputs():
    assert all(f.seed_printed is None for f in planner.seed_figures(seed_inputs(batch=128)))
    assert all(f.seed_printed is not None for f in planner.seed_figures(seed_inputs(ep=16, hw="h200")))


# --------------------------------------------------------------------------------- hand-worked models


def _miss(pool: int, outside: int, k: int) -> float:
    """P(a uniform k-subset of `pool` experts avoids a rank owning pool - outside of them)."""
    return math.comb(outside, k) / math.comb(pool, k)


def test_deepseek_v3_ep8_fanout_is_four_groups():
    # EP8: 32 experts per rank = one group; 4 groups kept -> 4 candidate ranks of 32 experts each;
    # a kept rank is missed when all 8 experts land in the other 3 groups (96 of 128).
    fan = planner.expected_fanout(PRESETS["deepseek-v3"], 8)
    assert fan.max_ranks == 4
    expected = 4 * (1 - _miss(128, 96, 8))
    assert fan.expected_ranks == pytest.approx(expected, rel=1e-12)
    assert fan.expected_remote_ranks == pytest.approx(expected * 7 / 8, rel=1e-12)


def test_deepseek_v2_lite_by_hand():
    cfg = PRESETS["deepseek-v2-lite"]  # H 2048, 64 experts, top-6, greedy, 27 layers, first dense 1
    inp = planner.PlanInputs(model=cfg, ep=8)
    model = planner.byte_model(inp)
    # Dispatch: 2048 FP8 + 16 fp32 scales + 6 x (int64 id + fp32 weight); combine: 2048 bf16.
    assert model.dispatch_row.total_B == 2048 + 16 * 4 + 6 * 12 == 2184
    assert model.combine_row.total_B == 4096
    ranks = 8 * (1 - _miss(64, 56, 6))  # each rank owns 8 of the 64 experts
    assert model.fanout.expected_ranks == pytest.approx(ranks, rel=1e-12)
    per_token = ranks * 7 / 8 * (2184 + 4096)
    assert model.bytes_per_token_B == pytest.approx(per_token)
    assert model.bytes_per_step_B == pytest.approx(26 * 256 * per_token)  # 27 layers - 1 dense
    seed = {f.key: f.exact for f in planner.seed_figures(inp)}
    assert seed["bytes_per_step"] == 27 * 2 * 256 * 2048
    assert model.dispatch_bytes_per_a2a_B == pytest.approx(128 * ranks * 7 / 8 * 2184)


def test_qwen3_30b_a3b_by_hand():
    cfg = PRESETS["qwen3-30b-a3b"]  # H 2048, 128 experts, top-8, greedy, 48 layers, no shared expert
    inp = planner.PlanInputs(model=cfg, ep=4, batch=64, tpot_ms=10.0)
    plan = planner.make_plan(inp)
    ranks = 4 * (1 - _miss(128, 96, 8))
    assert plan.bytes.fanout.expected_ranks == pytest.approx(ranks, rel=1e-12)
    assert plan.bytes.dispatch_row.total_B == 2048 + 64 + 96
    step_B = 48 * 64 * ranks * 3 / 4 * (2208 + 4096)
    assert plan.bytes.bytes_per_step_B == pytest.approx(step_B)
    assert plan.bytes.required_GBps_per_gpu == pytest.approx(step_B * 100 / 1e9)
    sbo = [v for v in plan.verdicts if v.mode.startswith("sbo")]
    assert sbo and all(v.fits is None and "no shared expert" in v.explanation for v in sbo)


def test_greedy_fanout_matches_the_router_monte_carlo():
    # For greedy routing, top-k of i.i.d. logits is a uniform k-subset: the exact model is the router.
    cfg = PRESETS["qwen3-30b-a3b"]
    exact = planner.expected_fanout(cfg, 8).expected_ranks
    assert planner.simulate_fanout(cfg, 8, num_tokens=4000, seed=1) == pytest.approx(exact, abs=0.05)


def test_tbo_window_and_transfer_time():
    plan = planner.make_plan(seed_inputs())
    tbo = next(v for v in plan.verdicts if v.mode == "tbo")
    assert tbo.window_us == 100
    model = plan.bytes
    combine_B = 128 * model.fanout.expected_remote_ranks * 14336
    assert tbo.work_us == pytest.approx(plan.link.latency_us + combine_B / (160 * 1e3))
    assert tbo.left_us == pytest.approx(100 - tbo.work_us)


def test_allgather_vs_alltoall():
    comparison = planner.scheme_comparison(seed_inputs(), planner.datasheet_link(planner.HARDWARE["h800"]))
    by_ep = {row.ep: row for row in comparison.rows}
    assert by_ep[4].ratio < 1.5 and by_ep[64].ratio > 8  # close at EP4, far apart at EP64
    for row in comparison.rows:
        assert row.allgather_B == pytest.approx((row.ep - 1) * 256 * (7488 + 14336))
        assert row.ratio >= 1
    assert comparison.crossover_ep in by_ep
    before = [row for row in comparison.rows if row.ep < comparison.crossover_ep]
    assert all(row.alltoall_us >= row.allgather_us for row in before)


# -------------------------------------------------------------------------------------------- properties


@st.composite
def moe_configs(draw):
    n_group = draw(st.integers(1, 8))
    group_size = draw(st.integers(1, 12))
    topk_group = draw(st.integers(1, n_group))
    k = draw(st.integers(1, min(8, topk_group * group_size)))
    method = "group_limited_greedy" if n_group > 1 else "greedy"
    cfg = MoEConfig(
        name="drawn",
        hidden_size=128 * draw(st.integers(1, 8)),
        moe_intermediate_size=64,
        num_experts=n_group * group_size,
        num_experts_per_tok=k,
        num_shared_experts=draw(st.integers(0, 2)),
        topk_method=method,
        scoring_func="softmax",
        norm_topk_prob=False,
        n_group=n_group,
        topk_group=topk_group,
        num_hidden_layers=draw(st.integers(1, 64)),
    )
    return cfg, draw(st.sampled_from(divisors(cfg.num_experts)))


@settings(max_examples=60, deadline=None)
@given(moe_configs())
def test_fanout_bounds(drawn):
    cfg, ep = drawn
    fan = planner.expected_fanout(cfg, ep)
    assert fan.max_ranks <= min(cfg.num_experts_per_tok, ep)
    assert 1 - 1e-9 <= fan.expected_ranks <= fan.max_ranks + 1e-9
    assert fan.expected_remote_ranks == pytest.approx(fan.expected_ranks * (ep - 1) / ep)
    assert all(0 <= p <= 1 for p in fan.hit_probability_by_rank)
    if cfg.topk_method != "greedy":
        # No more ranks than the kept groups can span.
        per_rank = cfg.num_experts // ep
        spans = sorted(
            (
                len({e // per_rank for e in range(g * cfg.experts_per_group, (g + 1) * cfg.experts_per_group)})
                for g in range(cfg.n_group)
            ),
            reverse=True,
        )
        assert fan.expected_ranks <= sum(spans[: cfg.topk_group]) + 1e-9


@settings(max_examples=40, deadline=None)
@given(moe_configs(), st.integers(1, 512), st.integers(2, 4), st.integers(1, 80))
def test_bytes_linear_in_batch_and_layers(drawn, batch, factor, layers):
    cfg, ep = drawn
    base = planner.byte_model(planner.PlanInputs(model=cfg, ep=ep, batch=batch, layers=layers, micro_batches=1))
    more_tokens = planner.byte_model(
        planner.PlanInputs(model=cfg, ep=ep, batch=batch * factor, layers=layers, micro_batches=1)
    )
    more_layers = planner.byte_model(
        planner.PlanInputs(model=cfg, ep=ep, batch=batch, layers=layers * factor, micro_batches=1)
    )
    assert more_tokens.bytes_per_layer_B == pytest.approx(factor * base.bytes_per_layer_B)
    assert more_tokens.bytes_per_step_B == pytest.approx(factor * base.bytes_per_step_B)
    assert more_layers.bytes_per_step_B == pytest.approx(factor * base.bytes_per_step_B)
    assert more_layers.bytes_per_layer_B == pytest.approx(base.bytes_per_layer_B)
    seed_base = {
        f.key: f.exact
        for f in planner.seed_figures(planner.PlanInputs(model=cfg, ep=ep, batch=batch, layers=layers, micro_batches=1))
    }
    seed_more = {
        f.key: f.exact
        for f in planner.seed_figures(
            planner.PlanInputs(model=cfg, ep=ep, batch=batch * factor, layers=layers, micro_batches=1)
        )
    }
    assert seed_more["bytes_per_step"] == factor * seed_base["bytes_per_step"]


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(sorted(PRESETS)),
    st.lists(st.integers(1, 4096), min_size=2, max_size=6, unique=True),
    st.sampled_from(sorted(planner.HARDWARE)),
)
def test_required_bandwidth_monotone_in_batch(preset, batches, hw):
    cfg = PRESETS[preset]
    batches = sorted(batches)
    inp = planner.PlanInputs(model=cfg, ep=math.gcd(8, cfg.num_experts), hw=hw, micro_batches=1)
    points = planner.sweep_batches(inp, batches, planner.datasheet_link(planner.HARDWARE[hw]))
    for lo, hi in zip(points, points[1:]):
        assert hi.required_GBps_per_gpu > lo.required_GBps_per_gpu
        assert hi.seed_required_GBps_per_gpu > lo.seed_required_GBps_per_gpu
        assert hi.t_combine_us >= lo.t_combine_us


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(batch=-1), "batch must be a positive"),
        (dict(batch=0), "batch must be a positive"),
        (dict(ep=3), "ep must divide the 256 routed experts"),
        (dict(hw="tpu-v5"), "hw must be one of"),
        (dict(micro_batches=3), "micro_batches must be 1 or 2"),
        (dict(dispatch_dtype="int4"), "dispatch_dtype must be fp8 or bf16"),
        (dict(memory_ep=(8, 12)), "memory_ep must be EP sizes that divide the 256 routed experts"),
        (dict(memory_ep=(0,)), "memory_ep must be EP sizes"),
        (dict(memory_ep=()), "memory_ep must be EP sizes"),
        (dict(shapes=planner.PRESET_SHAPES["qwen3-30b-a3b"]), "shapes must describe the planned model"),
    ],
)
def test_bad_inputs_raise_shaped_errors(changes, message):
    with pytest.raises(ValueError, match=message) as info:
        seed_inputs(**changes)
    assert ", got " in str(info.value) and "; " in str(info.value)


def test_unknown_preset_and_missing_calibrate_file(tmp_path):
    with pytest.raises(ValueError, match=r"model must be a preset .*got 'deepseek-v9'"):
        planner.load_model("deepseek-v9")
    with pytest.raises(ValueError, match="calibrate file must exist"):
        planner.calibrate(tmp_path / "missing.json")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"meta": {}, "rows": [{"bench": "layer", "t_layer_us": 10}]}))
    with pytest.raises(ValueError, match="got none usable among 1 rows"):
        planner.calibrate(empty)


@pytest.mark.parametrize(
    "argv",
    [
        ["--batch", "-4"],
        ["--ep", "5"],
        ["--hw", "a100"],
        ["--model", "nope"],
        ["--calibrate", "/nonexistent/result.json"],
        ["--memory-ep", "8", "7"],
    ],
)
def test_cli_bad_input_exits_2_without_traceback(argv, capsys):
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-sbo plan: error: ") and "Traceback" not in err


# ------------------------------------------------------------------------------------- HF config files


def test_hf_config_json_builds_the_same_shapes(tmp_path):
    v3 = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
    }
    (tmp_path / "config.json").write_text(json.dumps(v3))
    cfg = planner.load_model(str(tmp_path))
    assert cfg.replace(name="deepseek-v3") == PRESETS["deepseek-v3"]
    qwen = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "num_hidden_layers": 48,
    }
    path = tmp_path / "qwen.json"
    path.write_text(json.dumps(qwen))
    assert planner.load_model(str(path)).replace(name="qwen3-30b-a3b") == PRESETS["qwen3-30b-a3b"]
    path.write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(ValueError, match="model config must have moe_intermediate_size"):
        planner.load_model(str(path))


# --------------------------------------------------------------------------------------- weight memory

V3_CONFIG_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
}


def small_moe(**changes) -> MoEConfig:
    """H 320 and I 192 are not multiples of 128, so the fp8 scales count partial edge blocks."""
    sizes = dict(
        name="small",
        hidden_size=320,
        moe_intermediate_size=192,
        num_experts=16,
        num_experts_per_tok=2,
        num_shared_experts=1,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        num_hidden_layers=5,
        first_k_dense_replace=1,
    )
    return MoEConfig(**{**sizes, **changes})


def test_fp8_expert_bytes_are_half_of_bf16_plus_block_scales():
    cfg = small_moe()
    # gate and up [192, 320]: ceil(192/128) x ceil(320/128) = 2 x 3 blocks; down [320, 192]: 3 x 2.
    scales_B = 4 * (2 * 3 + 2 * 3 + 3 * 2)
    bf16_B = 2 * 3 * 192 * 320
    assert planner.expert_bytes(cfg, "bf16") == bf16_B == 368_640
    assert planner.expert_bytes(cfg, "fp8") == bf16_B // 2 + scales_B == 184_392
    memory = planner.weight_memory(cfg, [1])
    experts = cfg.num_moe_layers * cfg.num_experts  # 4 MoE layers x 16
    assert memory.routed_total_B == {"bf16": experts * bf16_B, "fp8": experts * (bf16_B // 2 + scales_B)}
    assert memory.fp8_scales_B == experts * scales_B
    assert memory.notes and "not a multiple of 128" in memory.notes[0]
    # DeepSeek-V3 (aligned): 3 matrices of 16 x 56 blocks, 10752 B of scales per expert, 0.0244 % extra.
    v3 = PRESETS["deepseek-v3"]
    assert planner.expert_bytes(v3, "fp8") == 3 * 2048 * 7168 + 4 * 3 * 16 * 56
    assert planner.expert_bytes(v3, "fp8") / planner.expert_bytes(v3, "bf16") == pytest.approx(0.5, rel=3e-4)
    assert planner.weight_memory(v3, [8]).notes == ()
    with pytest.raises(ValueError, match="expert dtype must be one of"):
        planner.expert_matrix_bytes(128, 128, "int4")


@pytest.mark.parametrize("preset", ["deepseek-v3", "qwen3-30b-a3b"])
def test_weight_memory_divides_routed_experts_by_ep(preset):
    cfg = PRESETS[preset]
    eps = [ep for ep in (1, 2, 4, 8, 16, 32) if cfg.num_experts % ep == 0]
    memory = planner.weight_memory(cfg, eps, planner.PRESET_SHAPES[preset])
    assert [(r.expert_dtype, r.ep) for r in memory.rows] == [(d, ep) for d in ("bf16", "fp8") for ep in eps]
    for row in memory.rows:
        assert row.experts_per_gpu * row.ep == cfg.num_experts
        assert row.routed_B * row.ep == memory.routed_total_B[row.expert_dtype]
        assert row.other_B == memory.other_B == sum(part.bytes_B for part in memory.parts)
        assert row.total_B == row.routed_B + row.other_B
        assert row.left_B == memory.gpu_memory_B - row.total_B == 141e9 - row.total_B
        assert row.fits == (row.left_B >= 0)
    with pytest.raises(ValueError, match="ep_sizes must divide the 256 routed experts"):
        planner.weight_memory(PRESETS["deepseek-v3"], [8, 3])


def test_deepseek_v3_weight_memory_totals():
    memory = planner.make_plan(seed_inputs()).weight_memory  # the preset: its published shapes
    # The figures: ~1.34 TB in bf16 (671B parameters x 2 B), ~0.69 TB in FP8.
    assert 1.33e12 <= memory.model_total_B["bf16"] <= 1.35e12
    assert 0.68e12 <= memory.model_total_B["fp8"] <= 0.70e12
    router_fp32_extra_B = 58 * (256 * 7168 + 256) * 2  # the router is float32, the rest 2 B per value
    params = (memory.model_total_B["bf16"] - router_fp32_extra_B) / 2
    assert 670e9 <= params <= 672e9  # DeepSeek-V3: 671B without its 14B multi-token-prediction module
    assert memory.routed_total_B["bf16"] == 58 * 256 * 3 * 7168 * 2048 * 2
    assert memory.fp8_scales_B == 58 * 256 * 3 * 16 * 56 * 4
    assert [p.name for p in memory.parts] == [
        "attention",
        "dense FFN",
        "shared experts",
        "router",
        "embeddings",
        "lm head",
        "norms",
    ]
    assert memory.other_B == pytest.approx(34.45e9, rel=1e-3)
    assert any("multi-token-prediction" in item for item in memory.not_counted)
    rows = {(r.expert_dtype, r.ep): r for r in memory.rows}
    assert rows["bf16", 8].routed_B == 58 * 32 * 3 * 7168 * 2048 * 2  # 163.5 GB: with the rest, over 141
    assert not rows["bf16", 8].fits and rows["bf16", 16].fits
    assert rows["fp8", 8].fits and rows["fp8", 8].total_B == pytest.approx(116.2e9, rel=1e-3)


@pytest.mark.parametrize(
    "preset, published_params",
    [("deepseek-v2-lite", 15.7e9), ("deepseek-v2", 236e9), ("deepseek-v3", 671e9), ("qwen3-30b-a3b", 30.5e9)],
)
def test_preset_shapes_give_the_published_parameter_counts(preset, published_params):
    memory = planner.weight_memory(PRESETS[preset], [1], planner.PRESET_SHAPES[preset])
    router = next(p for p in memory.parts if p.name == "router")
    params = (memory.model_total_B["bf16"] - router.bytes_B / 2) / 2
    assert params == pytest.approx(published_params, rel=0.005)


def test_weight_memory_names_what_it_cannot_count(tmp_path):
    moe_only = dict(V3_CONFIG_JSON)
    for key in ("num_attention_heads", "kv_lora_rank", "intermediate_size", "vocab_size"):
        del moe_only[key]
    (tmp_path / "config.json").write_text(json.dumps(moe_only))
    shapes = planner.load_shapes(str(tmp_path))
    assert shapes is not None and shapes.attention is None and shapes.vocab_size is None
    inp = planner.PlanInputs(model=planner.load_model(str(tmp_path)), shapes=shapes)
    memory = planner.make_plan(inp).weight_memory
    assert [p.name for p in memory.parts] == ["shared experts", "router", "norms"]
    missing = " | ".join(memory.not_counted)
    for part in ("attention of 61 layers", "FFN of the first 3 dense layer(s)", "embeddings and lm head"):
        assert part in missing
    assert "KV cache" in missing and "multi-token-prediction" in missing
    # A changed preset is not given the preset's shapes: it says so instead.
    changed = planner.make_plan(planner.PlanInputs(model=PRESETS["deepseek-v3"].replace(num_hidden_layers=30)))
    assert changed.weight_memory.shapes_source.startswith("none")
    assert any(item.startswith("attention of 30 layers") for item in changed.weight_memory.not_counted)


def test_hf_config_shapes_match_the_presets(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V3_CONFIG_JSON))
    shapes = planner.load_shapes(str(tmp_path))
    assert shapes == dataclasses.replace(planner.PRESET_SHAPES["deepseek-v3"], source=str(tmp_path / "config.json"))
    qwen = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    }
    assert planner.shapes_from_hf(qwen, "qwen") == dataclasses.replace(
        planner.PRESET_SHAPES["qwen3-30b-a3b"], source="qwen"
    )
    lite = {k: v for k, v in V3_CONFIG_JSON.items() if k != "num_nextn_predict_layers"}
    lite.update(hidden_size=2048, num_attention_heads=16, q_lora_rank=None, intermediate_size=10944, vocab_size=102400)
    assert planner.shapes_from_hf(lite, "lite") == dataclasses.replace(
        planner.PRESET_SHAPES["deepseek-v2-lite"], source="lite"
    )


def test_fp8_weight_block_is_the_fp8_modules():
    from moe_sbo.quant.fp8 import FP8_BLOCK

    assert planner.FP8_WEIGHT_BLOCK == FP8_BLOCK


@settings(max_examples=40, deadline=None)
@given(moe_configs())
def test_weight_memory_per_gpu_sums_to_the_model(drawn):
    cfg, ep = drawn
    memory = planner.weight_memory(cfg, [ep])
    for row in memory.rows:
        assert row.routed_B * ep == memory.routed_total_B[row.expert_dtype]
    # fp8 is half of bf16 plus scales: at most one fp32 scale per value-block, at least one per matrix.
    half_B = memory.routed_total_B["bf16"] // 2
    assert memory.routed_total_B["fp8"] == half_B + memory.fp8_scales_B
    assert memory.fp8_scales_B >= 3 * 4 * cfg.num_experts * cfg.num_moe_layers


# ------------------------------------------------------------------------------------------- calibrate


def test_calibrate_fits_bandwidth_and_latency(tmp_path):
    rows = [{"ep": 8, "bytes_sent": b, "t_comm_us": 7.0 + b / (120.0 * 1e3)} for b in (1e6, 2e6, 4e6, 8e6)]
    rows.append({"ep": 4, "bytes_sent": 1e6, "t_comm_us": 1e6})  # other EP: ignored when EP8 rows exist
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"meta": {"gpu": "test"}, "rows": rows}))
    cal = planner.calibrate(path, ep=8)
    assert cal.GBps == pytest.approx(120.0) and cal.latency_us == pytest.approx(7.0) and cal.num_rows == 4
    plan = planner.make_plan(seed_inputs(), cal)
    assert plan.link.nvlink_GBps == pytest.approx(120.0) and plan.link.source.startswith("calibrated")
    combine_B = 256 * plan.bytes.fanout.expected_remote_ranks * 14336
    assert plan.t_combine_us == pytest.approx(7.0 + combine_B / 120e3)


def test_calibrate_median_algbw_when_one_size(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(
        json.dumps(
            {
                "meta": {},
                "rows": [
                    {"algbw_GBps": 100.0, "ref_algbw_GBps": 150.0},
                    {"algbw_GBps": 140.0},
                    {"algbw_GBps": 90.0},
                    {"bytes_sent": 5e6, "t_dispatch_us": 20.0, "t_combine_us": 30.0},
                ],
            }
        )
    )
    cal = planner.calibrate(path)
    assert cal.GBps == 100.0 and cal.latency_us == 0.0 and "median algbw_GBps" in cal.method


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_default_reproduces_the_seed_and_writes_json_and_png(tmp_path, capsys):
    json_path, png_path = tmp_path / "plan.json", tmp_path / "plan.png"
    assert plan_main(["--detail", "--json", str(json_path), "--plot", str(png_path)]) == 0
    out = capsys.readouterr().out
    for figure in ("7 KB", "1.78 MB", "3.56 MB", "218 MB", "10.9 GB/s", "100 us"):
        assert figure in out
    assert f"plan written to {json_path}\nplot written to {png_path}\n" in out  # where the files went
    assert "OFF" not in out
    doc = json.loads(json_path.read_text())
    for key in (
        "bytes_per_token",
        "bytes_per_a2a",
        "bytes_per_layer",
        "bytes_per_step",
        "required_GBps_per_gpu",
        "a2a_budget_us",
    ):
        assert {"seed_rounded", "seed_exact", "model"} <= set(doc[key]), key
        assert abs(doc[key]["seed_agreement"]) <= 0.03
    assert doc["inputs"]["batch"] == 256 and doc["inputs"]["model"] == "deepseek-v3"
    assert doc["bytes_per_a2a"]["seed_exact"] == 1_835_008
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The weight-memory table, the model totals, and what it leaves out.
    for text in ("Weight memory per GPU, deepseek-v3", "= 1.34 TB", "= 0.69 TB", "not counted:", "attention 22.8 GB"):
        assert text in out
    memory = doc["weight_memory"]
    assert [(r["expert_dtype"], r["ep"]) for r in memory["rows"]] == [
        (d, ep) for d in ("bf16", "fp8") for ep in (8, 16)
    ]
    assert memory["shapes"]["vocab_size"] == 129280 and doc["inputs"]["memory_ep_sizes"] == [8, 16]


def test_cli_memory_ep_option(capsys):
    assert plan_main(["--model", "qwen3-30b-a3b", "--memory-ep", "4", "32"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Weight memory per GPU, qwen3-30b-a3b") :]
    rows = [line.split() for line in table.splitlines() if line.startswith(("bf16 ", "fp8 "))]
    assert [(r[0], r[3] if r[0] == "fp8" else r[1]) for r in rows] == [  # "fp8 + scales EP ..."
        ("bf16", "4"),
        ("bf16", "32"),
        ("fp8", "4"),
        ("fp8", "32"),
    ]


def test_cli_other_model_with_calibration(tmp_path, capsys):
    result = tmp_path / "bench.json"
    result.write_text(
        json.dumps(
            {
                "meta": {},
                "rows": [
                    {"ep": 4, "bytes_sent": 1e6, "t_comm_us": 15.0},
                    {"ep": 4, "bytes_sent": 3e6, "t_comm_us": 35.0},
                ],
            }
        )
    )
    json_path = tmp_path / "q.json"
    argv = [
        "--model",
        "qwen3-30b-a3b",
        "--ep",
        "4",
        "--batch",
        "64",
        "--calibrate",
        str(result),
        "--micro-batches",
        "1",
        "--json",
        str(json_path),
        "--detail",
    ]
    assert plan_main(argv) == 0
    doc = json.loads(json_path.read_text())
    assert doc["link"]["nvlink_GBps"] == pytest.approx(100.0) and doc["link"]["latency_us"] == pytest.approx(5.0)
    assert doc["bytes_per_a2a"]["seed_printed"] is None
    assert "The published budget's convention on your inputs" in capsys.readouterr().out


def test_no_overlap_fits_when_compute_alone_exceeds_the_tpot():
    """The worked example's inputs: 58 MoE layers x (T + t = 440 us) = 25.5 ms of compute, over the 20 ms
    TPOT: whatever an overlap hides, the step misses it, and the verdict says so (not "fits")."""
    plan = planner.make_plan(planner.PlanInputs(model=PRESETS["deepseek-v3"]))
    assert plan.compute_ms == pytest.approx(58 * 440 / 1000) and plan.compute_exceeds_tpot
    assert any(v.fits for v in plan.verdicts if v.mode != "none")  # each window alone would hide its work
    assert planner.closing_verdict(plan) == (
        "verdict: no overlap fits: compute alone is 25.5 ms (58 x 440 us) > 20 ms TPOT"
    )
    relaxed = planner.make_plan(planner.PlanInputs(model=PRESETS["deepseek-v3"], tpot_ms=40))
    assert not relaxed.compute_exceeds_tpot
    assert planner.closing_verdict(relaxed).startswith("verdict: serial a2a fits the 40 ms TPOT; overlaps that fit:")
    assert planner.plan_to_json(plan)["verdict"] == planner.closing_verdict(plan)
