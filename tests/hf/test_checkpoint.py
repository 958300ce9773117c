"""Checkpoints on disk: configs, tensor names, per-rank reads, FP8 block dequantisation, FP8 experts
read as stored, bad input."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from hf_blocks import make_hf_model, quantize_fp8_blocks, write_broken_v3, write_checkpoint, write_published_v3
from moe_sbo.config import PRESETS
from moe_sbo.hf import assembly as assembly_module
from moe_sbo.hf.checkpoint import Checkpoint, LayerLoader
from moe_sbo.hf.config import config_from_hf, moe_layer_indices
from moe_sbo.hf.reference import reference_moe_block, weights_from_hf_moe
from moe_sbo.layer import MoELayer
from moe_sbo.quant import fp8
from moe_sbo.quant.fp8 import dequantize_fp8_blocks
from moe_sbo.weights import layer_weights

FAMILIES = ("deepseek_v3", "deepseek_v2", "qwen3_moe")
P = "model.layers.1.mlp."


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (model, single-file dir, sharded dir), written by transformers' save_pretrained."""
    out = {}
    for family in FAMILIES:
        model = make_hf_model(family, seed=3)
        single, sharded = tmp_path_factory.mktemp(f"{family}_single"), tmp_path_factory.mktemp(f"{family}_sharded")
        model.save_pretrained(single)
        model.save_pretrained(sharded, max_shard_size="40KB")
        out[family] = (model, single, sharded)
    return out


# ---- config.json --------------------------------------------------------------------------------


def test_published_configs_give_the_presets():
    """config.json fields as the Hub files spell them (Qwen3 counts experts as num_experts)."""
    v3 = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "num_hidden_layers": 61,
        "quantization_config": {"fmt": "e4m3", "weight_block_size": [128, 128]},
    }
    kimi = {
        **v3,
        "model_type": "kimi_k2",
        "n_routed_experts": 384,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "first_k_dense_replace": 1,
    }
    qwen = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
    }
    for config, preset in ((v3, "deepseek-v3"), (kimi, "kimi-k2"), (qwen, "qwen3-30b-a3b")):
        assert config_from_hf(config, name=preset) == PRESETS[preset]
    assert moe_layer_indices(v3) == list(range(3, 61))
    assert moe_layer_indices(qwen) == list(range(48))


def test_moe_layer_rules():
    deepseek = {"model_type": "deepseek_v2", "num_hidden_layers": 8, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    assert moe_layer_indices(deepseek) == [2, 4, 6]
    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert moe_layer_indices(qwen) == [1, 5, 7]  # (n + 1) % 2 == 0, minus layer 3


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_layers_from_save_pretrained(saved, family):
    model, single, _ = saved[family]
    checkpoint = Checkpoint(single)
    assert checkpoint.moe_config == config_from_hf(model.config, name=single.name)
    assert checkpoint.moe_layers == [1] and checkpoint.resolve_layer(None) == 1


# ---- tensor names and values -------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_read_equals_the_transformers_model(saved, family, layout):
    model, single, sharded = saved[family]
    weights, report = Checkpoint(single if layout == "single" else sharded).read_moe_weights(1)
    expected = weights_from_hf_moe(model.model.layers[1].mlp)
    for field in expected.__dataclass_fields__:
        got, want = getattr(weights, field), getattr(expected, field)
        assert (got is None) == (want is None), field
        if want is not None:
            assert torch.equal(got, want), field
    parts = [getattr(expected, f) for f in expected.__dataclass_fields__]
    assert report.bytes_read == 4 * sum(t.numel() for t in parts if t is not None)  # float32 on disk


def test_sharded_read_opens_only_needed_files(saved):
    """save_pretrained shards by size: a read opens the shards of layer 1's MoE, not the others."""
    _, _, sharded = saved["deepseek_v3"]
    checkpoint = Checkpoint(sharded)
    _, report = checkpoint.read_moe_weights(1, range(0, 8))
    needed = {checkpoint.weight_map[n] for n in report.tensors}
    assert set(report.files) == needed
    assert len(set(checkpoint.weight_map.values())) > len(needed)
    assert all(
        ".experts." not in n or int(n.split(".experts.")[1].split(".")[0]) < 8
        for n in report.tensors
        if ".shared_experts." not in n
    )


def _per_rank_read(device, path):
    """On each rank: an alltoall layer that reads only its experts, and the answer of the full read."""
    checkpoint = Checkpoint(path)
    load = LayerLoader(checkpoint, 1)
    layer = load(MoELayer(checkpoint.moe_config, dispatcher="alltoall", dtype=torch.float32))
    reference = load(MoELayer(checkpoint.moe_config, dispatcher="local", dtype=torch.float32))
    x = torch.randn(
        13 + dist.get_rank(),
        checkpoint.moe_config.hidden_size,
        generator=torch.Generator().manual_seed(dist.get_rank()),
    )
    with torch.no_grad():
        y, ref = layer(x), reference(x)
    return load.report(layer), ((y - ref).norm() / ref.norm()).item()


def test_each_rank_opens_only_the_shards_of_its_experts(tmp_path, ranks2):
    path, _ = write_published_v3(tmp_path, fp8=False)  # shard 1: experts 0-3, 2: experts 4-7, 3: router+shared
    (report0, err0), (report1, err1) = ranks2.run(_per_rank_read, str(path))
    assert report0.files == ("model-00003-of-00003.safetensors", "model-00001-of-00003.safetensors")
    assert report1.files == ("model-00003-of-00003.safetensors", "model-00002-of-00003.safetensors")
    assert report1.expert_ids == range(4, 8)
    expert_names = {n for n in report1.tensors if ".experts." in n and "shared" not in n}
    projections = ("gate_proj", "up_proj", "down_proj")
    assert expert_names == {f"{P}experts.{e}.{p}.weight" for e in range(4, 8) for p in projections}
    h, i = 160, 96  # router bf16, bias float32, 4 experts and the shared one float32
    assert report1.bytes_read == 8 * h * 2 + 8 * 4 + 4 * 3 * h * i * 4 + 3 * h * i * 4
    assert err0 <= 1e-6 and err1 <= 1e-6


def test_stacked_experts_are_read_by_rows(tmp_path):
    path, originals = write_published_v3(tmp_path, fp8=False, layout="stacked")
    weights, report = Checkpoint(path).read_moe_weights(1, range(2, 4))
    assert torch.equal(weights.gate_up_proj_E2IH, originals[P + "experts.gate_up_proj"][2:4])
    assert torch.equal(weights.down_proj_EHI, originals[P + "experts.down_proj"][2:4])
    h, i = 160, 96
    assert report.bytes_read == 8 * h * 2 + 8 * 4 + 2 * 3 * h * i * 4 + 3 * h * i * 4  # 2 of 8 experts' rows


def test_kimi_k2_checkpoint_matches_transformers_deepseek_v3_block(tmp_path):
    """Kimi-K2 ships DeepSeek-V3's architecture under its own model_type: same names, same reference."""
    path, _ = write_published_v3(tmp_path, fp8=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2", "n_group": 1, "topk_group": 1}))
    checkpoint = Checkpoint(path)
    assert checkpoint.model_type == "kimi_k2" and checkpoint.moe_config.topk_method == "noaux_tc"
    layer = LayerLoader(checkpoint, 1)(MoELayer(checkpoint.moe_config, dtype=torch.float32))
    block = reference_moe_block(checkpoint.hf_config, checkpoint.read_moe_weights(1, dtype=torch.float32)[0])
    assert type(block).__name__ == "DeepseekV3MoE"
    x = torch.randn(37, checkpoint.moe_config.hidden_size)
    with torch.no_grad():
        ref = block(x[None])[0]
        assert ((layer(x) - ref).norm() / ref.norm()).item() <= 1e-5


# ---- FP8 ---------------------------------------------------------------------------------------


def test_fp8_block_dequantisation_crops_edge_tiles():
    w = torch.randn(300, 160)  # 3 x 2 tiles, the last row and column of tiles cropped
    q, scale = quantize_fp8_blocks(w)
    assert scale.shape == (3, 2)
    expected = torch.empty(300, 160)
    for bo in range(3):
        for bi in range(2):
            tile = (slice(128 * bo, 128 * bo + 128), slice(128 * bi, 128 * bi + 128))
            expected[tile] = q[tile].float() * scale[bo, bi]
    got = dequantize_fp8_blocks(q, scale)
    assert torch.equal(got, expected)
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself, or of the tile's smallest normal.
    assert bool(((got - w).abs() <= w.abs() / 16 + 2**-6 * scale.max()).all())


def test_fp8_checkpoint_dequantises_to_the_originals(tmp_path):
    path, originals = write_published_v3(tmp_path, fp8=True)
    checkpoint = Checkpoint(path)
    weights, report = checkpoint.read_moe_weights(1, dtype=torch.float32)
    i = 96
    for e, name in ((0, "gate_proj"), (7, "up_proj")):
        orig = originals[f"{P}experts.{e}.{name}.weight"]
        got = weights.gate_up_proj_E2IH[e, :i] if name == "gate_proj" else weights.gate_up_proj_E2IH[e, i:]
        assert torch.allclose(got, orig, rtol=1 / 16, atol=orig.abs().max().item() / 448)
        assert ((got - orig).norm() / orig.norm()).item() < 0.05
    shared_down = originals[P + "shared_experts.down_proj.weight"]
    assert torch.allclose(
        weights.shared_down_proj_HJ, shared_down, rtol=1 / 16, atol=shared_down.abs().max().item() / 448
    )
    assert torch.equal(weights.router_weight_EH, originals[P + "gate.weight"])  # bf16 on disk, not quantised
    # Default dtype: FP8 weights come back bf16; bytes read count 1 B per FP8 element plus the scales.
    default, report_default = checkpoint.read_moe_weights(1, range(0, 4))
    assert default.gate_up_proj_E2IH.dtype == torch.bfloat16 and default.router_weight_EH.dtype == torch.float32
    h = 160
    scales = 4 * 3 * 2 + 3 * 2  # 2 tiles per expert weight ([96,160]: 1x2; [160,96]: 2x1), 4 experts + shared
    assert report_default.bytes_read == 8 * h * 2 + 8 * 4 + (4 * 3 + 3) * h * i + scales * 4
    assert torch.equal(default.gate_up_proj_E2IH, weights.gate_up_proj_E2IH[:4].bfloat16())


# ---- FP8 routed experts kept in FP8 (fp8_experts=True) ------------------------------------------

# Sizes FP8 experts accept (multiples of 128), kept small: 4 experts of [2 * 128, 256] and [256, 128].
FP8_SIZES = dict(hidden=256, inter=128, experts=4)


def _stored(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, as stored."""
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_fp8_read_copies_the_stored_bytes_and_scales(tmp_path, monkeypatch):
    path, _ = write_published_v3(tmp_path, fp8=True, **FP8_SIZES)
    stored = _stored(path)
    widened = []  # shapes of every FP8 tensor dequantised: the shared experts' only

    def dequantize(weight, scale_inv, block):
        widened.append(tuple(weight.shape))
        return dequantize_fp8_blocks(weight, scale_inv, block)

    def no_quantize(*args):
        raise AssertionError("FP8-stored 128x128 experts must be copied as stored, not requantised")

    monkeypatch.setattr(assembly_module, "dequantize_fp8_blocks", dequantize)
    monkeypatch.setattr(assembly_module, "quantize_fp8_blocks", no_quantize)
    weights, report = Checkpoint(path).read_moe_weights(1, range(2, 4), dtype=torch.float32, fp8_experts=True)
    i = FP8_SIZES["inter"]
    assert weights.gate_up_proj_E2IH.dtype == weights.down_proj_EHI.dtype == torch.float8_e4m3fn
    assert weights.gate_up_proj_scale_inv.shape == (2, 2, 2) and weights.down_proj_scale_inv.shape == (2, 2, 1)
    for row, expert in enumerate(range(2, 4)):  # this rank's experts 2 and 3, gate rows first
        name = f"{P}experts.{expert}."
        for got, got_scale, proj in (
            (weights.gate_up_proj_E2IH[row, :i], weights.gate_up_proj_scale_inv[row, : i // 128], "gate_proj"),
            (weights.gate_up_proj_E2IH[row, i:], weights.gate_up_proj_scale_inv[row, i // 128 :], "up_proj"),
            (weights.down_proj_EHI[row], weights.down_proj_scale_inv[row], "down_proj"),
        ):
            assert torch.equal(_bytes(got), _bytes(stored[name + proj + ".weight"])), (expert, proj)
            assert torch.equal(got_scale, stored[name + proj + ".weight_scale_inv"]), (expert, proj)
    # Shared experts stay dense (dequantised in float32, as without fp8_experts); the router as stored.
    shared = f"{P}shared_experts.down_proj.weight"
    assert torch.equal(
        weights.shared_down_proj_HJ, dequantize_fp8_blocks(stored[shared], stored[shared + "_scale_inv"])
    )
    assert torch.equal(weights.router_weight_EH, stored[P + "gate.weight"].float())
    assert sorted(widened) == sorted([(i, 256), (i, 256), (256, i)])
    # bytes_read: the stored bytes of every tensor read (1 B per FP8 value, 4 B per scale), no more.
    assert report.bytes_read == sum(stored[n].numel() * stored[n].element_size() for n in report.tensors)
    assert report.files == ("model-00003-of-00003.safetensors", "model-00002-of-00003.safetensors")


def test_fp8_layer_loaded_from_an_fp8_checkpoint_holds_the_stored_bytes(tmp_path):
    path, _ = write_published_v3(tmp_path, fp8=True, **FP8_SIZES)
    stored, checkpoint = _stored(path), Checkpoint(path)
    load = LayerLoader(checkpoint, 1)
    fp8_layer = load(MoELayer(checkpoint.moe_config, dtype=torch.float32, expert_dtype="fp8"))
    dense_layer = load(MoELayer(checkpoint.moe_config, dtype=torch.float32))
    assert len(load.reports) == 2  # one read per expert format: the FP8 one is not the dense one's
    assert load.report(fp8_layer) is not load.report(dense_layer)
    experts = fp8_layer.experts
    for expert in range(FP8_SIZES["experts"]):
        name = f"{P}experts.{expert}."
        gate_up = torch.cat([stored[name + "gate_proj.weight"], stored[name + "up_proj.weight"]])
        gate_up_scale = torch.cat(
            [stored[name + "gate_proj.weight_scale_inv"], stored[name + "up_proj.weight_scale_inv"]]
        )
        assert torch.equal(_bytes(experts.gate_up_proj[expert]), _bytes(gate_up))
        assert torch.equal(_bytes(experts.down_proj[expert]), _bytes(stored[name + "down_proj.weight"]))
        assert torch.equal(experts.gate_up_proj_scale_inv[expert], gate_up_scale)
        assert torch.equal(experts.down_proj_scale_inv[expert], stored[name + "down_proj.weight_scale_inv"])
    # The dense layer holds the same weights dequantised: the outputs differ by activation rounding only
    # (two e4m3 quantisations, ~2.6% RMS each).
    x = torch.randn(32, checkpoint.moe_config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y, ref = fp8_layer(x), dense_layer(x)
    assert 1e-3 < ((y - ref).norm() / ref.norm()).item() <= 6e-2


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_fp8_read_of_a_dense_checkpoint_quantises_each_expert(tmp_path, layout):
    path, originals = write_published_v3(tmp_path, fp8=False, layout=layout, **FP8_SIZES)
    weights, report = Checkpoint(path).read_moe_weights(1, range(1, 3), fp8_experts=True)
    i = FP8_SIZES["inter"]
    for row, expert in enumerate(range(1, 3)):
        if layout == "stacked":
            gate_up = originals[P + "experts.gate_up_proj"][expert]
            down = originals[P + "experts.down_proj"][expert]
        else:
            name = f"{P}experts.{expert}."
            gate_up = torch.cat([originals[name + "gate_proj.weight"], originals[name + "up_proj.weight"]])
            down = originals[name + "down_proj.weight"]
        for dense, q, scale_inv in (
            (gate_up, weights.gate_up_proj_E2IH[row], weights.gate_up_proj_scale_inv[row]),
            (down, weights.down_proj_EHI[row], weights.down_proj_scale_inv[row]),
        ):
            # What MoELayer(expert_dtype="fp8").load_weights makes of the dense weight, bit for bit
            # (gate and up quantised apart tile the same: I is a multiple of 128)...
            expected_q, expected_scale = fp8.quantize_fp8_blocks(dense)
            assert torch.equal(_bytes(q), _bytes(expected_q)) and torch.equal(scale_inv, expected_scale)
            # ...so within e4m3's rounding of the dense values: 2^-4 relative, or half a subnormal step.
            got = dequantize_fp8_blocks(q, scale_inv)
            assert bool(((got - dense).abs() <= dense.abs() / 16 + scale_inv.max() * 2**-10).all())
    assert weights.shared_down_proj_HJ.dtype == torch.float32  # as stored: dense stays dense
    h = FP8_SIZES["hidden"]
    rows = 2 * 3 * h * i * 4  # 2 experts' float32 weights, as stored, whichever layout
    assert report.bytes_read == 4 * h * 2 + 4 * 4 + rows + 3 * h * i * 4


def test_fp8_read_requantises_other_block_sizes_at_128(tmp_path):
    """A checkpoint with 64x64 blocks: each weight dequantised at 64, quantised again at 128."""
    path, originals = write_published_v3(tmp_path / "dense", fp8=False, **FP8_SIZES)
    tensors, config = _stored(path), json.loads((path / "config.json").read_text())
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(originals[name], block=64)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}
    blocks64 = write_checkpoint(tmp_path / "blocks64", config, tensors)
    weights, _ = Checkpoint(blocks64).read_moe_weights(1, range(0, 2), fp8_experts=True)
    name = f"{P}experts.1.down_proj.weight"
    expected = fp8.quantize_fp8_blocks(dequantize_fp8_blocks(tensors[name], tensors[name + "_scale_inv"], (64, 64)))
    assert torch.equal(_bytes(weights.down_proj_EHI[1]), _bytes(expected[0]))
    assert torch.equal(weights.down_proj_scale_inv[1], expected[1])
    assert weights.down_proj_scale_inv.shape == (2, 2, 1)  # 128x128 blocks, whatever the checkpoint's


def test_fp8_read_needs_sizes_in_whole_blocks(tmp_path):
    path, _ = write_published_v3(tmp_path, fp8=True)  # hidden 160, moe_intermediate_size 96
    checkpoint = Checkpoint(path)
    with pytest.raises(
        ValueError,
        match=r"config.json: FP8 experts need hidden_size and moe_intermediate_size that are multiples of 128 "
        r".*got \{'hidden_size': 160, 'moe_intermediate_size': 96\}; read this model with fp8_experts=False",
    ):
        checkpoint.read_moe_weights(1, range(0, 4), fp8_experts=True)
    checkpoint.read_moe_weights(1, range(0, 4))  # dense experts of the same model: fine


# ---- bad input ---------------------------------------------------------------------------------


def test_missing_config_json(tmp_path):
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"config.json is missing"):
        Checkpoint(tmp_path)
    with pytest.raises(ValueError, match="checkpoint must be a directory.*does not exist"):
        Checkpoint(tmp_path / "nowhere")


def test_unsupported_architecture_lists_the_supported(tmp_path):
    config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"config.json: model must be one of the supported families \(model_type "
        r"deepseek_v2, deepseek_v3, kimi_k2, qwen3_moe.*got model_type 'mixtral'",
    ):
        Checkpoint(tmp_path)


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_moe",
                "hidden_size": 8,
                "moe_intermediate_size": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
            }
        )
    )
    with pytest.raises(ValueError, match="must hold model.safetensors or model.safetensors.index.json, got neither"):
        Checkpoint(tmp_path)


def test_layer_out_of_range_or_dense(saved):
    checkpoint = Checkpoint(saved["qwen3_moe"][1])
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\) \(num_hidden_layers=2\), got 5; MoE layers: 1"):
        checkpoint.read_moe_weights(5)
    with pytest.raises(
        ValueError,
        match=r"layer must be an MoE layer, got dense layer 0 \(MoE iff layer not in "
        r"mlp_only_layers=\[0\].*MoE layers: 1",
    ):
        checkpoint.validate_layer(0)


def test_missing_expert_names_the_tensor_and_file(tmp_path):
    path = write_broken_v3(tmp_path, sharded=True, drop=[f"{P}experts.5.up_proj.weight"])
    checkpoint = Checkpoint(path)
    checkpoint.read_moe_weights(1, range(0, 4))  # rank 0's half is complete
    with pytest.raises(
        ValueError,
        match=r"model.safetensors.index.json: tensor model.layers.1.mlp.experts.5.up_proj"
        r".weight \(expert 5 of layer 1\) is missing",
    ):
        checkpoint.read_moe_weights(1, range(4, 8))
    with pytest.raises(ValueError, match="experts.5.up_proj.weight"):
        checkpoint.validate_layer(1)


def test_missing_fp8_scale_names_the_tensor_and_file(tmp_path):
    path = write_broken_v3(tmp_path, sharded=True, fp8=True, drop=[f"{P}experts.2.down_proj.weight_scale_inv"])
    with pytest.raises(
        ValueError,
        match=r"model-00001-of-00001.safetensors: tensor model.layers.1.mlp.experts.2."
        r"down_proj.weight \(expert 2 of layer 1\) is float8 e4m3 but its block "
        r"scale model.layers.1.mlp.experts.2.down_proj.weight_scale_inv is missing",
    ):
        Checkpoint(path).validate_layer(None)


def test_shape_mismatch_names_the_tensor_and_file(tmp_path):
    path = write_broken_v3(tmp_path, sharded=True, replace={f"{P}experts.6.gate_proj.weight": torch.zeros(96, 128)})
    with pytest.raises(
        ValueError,
        match=r"model-00001-of-00001.safetensors: tensor model.layers.1.mlp.experts.6."
        r"gate_proj.weight must have shape \(96, 160\), got \(96, 128\)",
    ):
        Checkpoint(path).read_moe_weights(1, range(4, 8))
    bad_scale = write_broken_v3(
        tmp_path / "fp8", sharded=True, fp8=True, replace={f"{P}experts.0.gate_proj.weight_scale_inv": torch.ones(1, 1)}
    )
    with pytest.raises(ValueError, match=r"gate_proj.weight_scale_inv must have shape \(1, 2\), got \(1, 1\)"):
        Checkpoint(bad_scale).validate_layer(1)


def test_missing_shard_file_is_named(tmp_path):
    path, _ = write_published_v3(tmp_path, fp8=False)
    (path / "model-00002-of-00003.safetensors").unlink()
    checkpoint = Checkpoint(path)
    checkpoint.read_moe_weights(1, range(0, 4))  # rank 0 never needs the lost shard
    with pytest.raises(
        ValueError,
        match=r"model-00002-of-00003.safetensors is missing; .*index.json places "
        r"model.layers.1.mlp.experts.4",
    ):
        checkpoint.read_moe_weights(1, range(4, 8))


def test_load_weights_refuses_another_ranks_experts(tmp_path):
    path, _ = write_published_v3(tmp_path, fp8=False)
    checkpoint = Checkpoint(path)
    weights, _ = checkpoint.read_moe_weights(1, range(4, 8), dtype=torch.float32)
    layer = MoELayer(checkpoint.moe_config, dtype=torch.float32)  # one rank: owns all 8 experts
    with pytest.raises(ValueError, match=r"must hold all 8 experts or this rank's experts 0..7, got experts 4..7"):
        layer.load_weights(weights, expert_ids=range(4, 8))
    with pytest.raises(ValueError, match=r"must hold all 8 experts or this rank's experts 0..7, got 4 experts"):
        layer.load_weights(weights)
    with pytest.raises(ValueError, match="expert_ids must be a contiguous range inside"):
        checkpoint.read_moe_weights(1, range(6, 10))


def test_layer_loader_reads_experts_straight_into_the_layer(tmp_path):
    path, _ = write_published_v3(tmp_path, fp8=False)
    checkpoint = Checkpoint(path)
    layer = MoELayer(checkpoint.moe_config, dispatcher="local", seed=None)  # uninitialised until loaded
    gate_up = layer.experts.gate_up_proj
    LayerLoader(checkpoint, 1)(layer)
    weights, _ = checkpoint.read_moe_weights(1, dtype=layer.dtype)
    assert layer.experts.gate_up_proj is gate_up  # filled in place: no second copy of the experts
    assert torch.equal(gate_up, weights.gate_up_proj_E2IH) and torch.equal(
        layer.experts.down_proj, weights.down_proj_EHI
    )
    # ``into`` is returned as given, and must have the read's shape and dtype.
    into = layer_weights(layer)
    got, _ = checkpoint.read_moe_weights(1, dtype=layer.dtype, into=into)
    assert got.gate_up_proj_E2IH is into.gate_up_proj_E2IH
    with pytest.raises(ValueError, match="the tensor to read gate_up into must be"):
        checkpoint.read_moe_weights(1, dtype=torch.float64, into=into)
