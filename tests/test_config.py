import pytest

from moe_sbo.config import PRESETS, get_preset

# (E, K, shared, H, I, method, scoring, norm, scale, groups, kept) from each model's config.json.
PUBLISHED = {
    "deepseek-v2-lite": (64, 6, 2, 2048, 1408, "greedy", "softmax", False, 1.0, 1, 1),
    "deepseek-v2": (160, 6, 2, 5120, 1536, "group_limited_greedy", "softmax", False, 16.0, 8, 3),
    "deepseek-v3": (256, 8, 1, 7168, 2048, "noaux_tc", "sigmoid", True, 2.5, 8, 4),
    "qwen3-30b-a3b": (128, 8, 0, 2048, 768, "greedy", "softmax", True, 1.0, 1, 1),
    "kimi-k2": (384, 8, 1, 7168, 2048, "noaux_tc", "sigmoid", True, 2.827, 1, 1),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_configs(name):
    c = get_preset(name)
    assert (
        c.num_experts,
        c.num_experts_per_tok,
        c.num_shared_experts,
        c.hidden_size,
        c.moe_intermediate_size,
        c.topk_method,
        c.scoring_func,
        c.norm_topk_prob,
        c.routed_scaling_factor,
        c.n_group,
        c.topk_group,
    ) == PUBLISHED[name]


def test_tiny_has_v3_routing_structure():
    tiny, v3 = get_preset("tiny"), get_preset("deepseek-v3")
    assert (tiny.topk_method, tiny.scoring_func, tiny.norm_topk_prob) == (v3.topk_method, v3.scoring_func, True)
    assert tiny.n_group > tiny.topk_group > 0 and tiny.num_shared_experts == 1
    assert set(PRESETS) == {*PUBLISHED, "tiny"}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_experts_per_tok": 17}, "top-k"),
        ({"n_group": 3}, "n_group must divide num_experts"),
        ({"topk_group": 5}, "topk_group must be in"),
        ({"topk_method": "random"}, "topk_method must be one of"),
        ({"n_group": 16, "topk_group": 4}, "top-2"),
    ],
)
def test_bad_configs_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        get_preset("tiny").replace(**changes)


def test_experts_per_rank_and_bad_ep_size():
    assert get_preset("deepseek-v3").experts_per_rank(4) == 64
    with pytest.raises(ValueError, match="divisible by the EP size.*choose an EP size among"):
        get_preset("tiny").experts_per_rank(3)
    with pytest.raises(ValueError, match="preset must be one of"):
        get_preset("deepseek-v4")
