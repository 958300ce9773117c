"""moe-sbo inside vLLM 0.33.0, through vLLM's own classes, on gloo CPU ranks (vLLM's CPU platform).

Each rank sets up vLLM's distributed state as a torchrun-style job does (``external_launcher``: vLLM
takes the group the ranks already form; DP = EP = ranks, TP 1) and loads the plugin with vLLM's
``load_general_plugins`` (the ``vllm.general_plugins`` entry point). What runs is vLLM's:

- its backend selection, ``all2all_utils.maybe_make_prepare_finalize``, with its own
  ``DeepEPHTAll2AllManager`` / ``DeepEPLLAll2AllManager`` (made here on the EP group's CPU group:
  vLLM's CPU communicator makes only its allgather/reduce-scatter manager);
- its modular kernel, ``FusedMoEKernel``, with moe-sbo's prepare/finalize (every dispatcher) and with
  vLLM's own ``DeepEPHTPrepareAndFinalize`` / ``DeepEPLLPrepareAndFinalize`` over ``moe_sbo.deep_ep``;
- the reference: ``FusedMoEKernel`` with vLLM's no-DP/EP prepare/finalize and every expert on one rank.

vLLM's naive DP/EP path (allgather + reduce-scatter) does not run here: on its CPU platform it calls
``all_gatherv`` of vLLM's CPU communicator, which 0.33.0 does not implement (``NotImplementedError``).

The experts are ``vllm_moe.TorchExperts`` / ``TorchBatchedExperts`` (vLLM's compiled CPU ops are not in
its CUDA wheel). Tolerances: fp32 1e-5 relative, bf16 2e-2; SBO modes equal ``none`` bitwise.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM test environment (make test-vllm)")

import torch

from moe_sbo.hooks import HOOK_EVENTS
from moe_sbo.launch.ranks import LocalRanks

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 64, 32, 8, 2, 6
LL_HIDDEN = 2048  # vLLM's DeepEP low-latency class accepts only its list of hidden sizes
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
RANK_ENV = {"VLLM_TARGET_DEVICE": "cpu", "MOE_SBO_VLLM": "1"}


@pytest.fixture(scope="module")
def vllm_ranks():
    """``vllm_ranks(P)``: P gloo ranks with vLLM's CPU platform, started at their first call."""
    started: dict[int, LocalRanks] = {}

    def get(world: int) -> LocalRanks:
        if world not in started:
            started[world] = LocalRanks(world, device="cpu", environ=RANK_ENV).__enter__()
        return started[world]

    yield get
    for ranks in started.values():
        ranks.__exit__(None, None, None)


# ---- on each rank --------------------------------------------------------------------------------

_VLLM_STATE: dict = {}


def _vllm_state(backend: str):
    """vLLM's config and distributed state on this rank (made once; the backend is per call)."""
    import torch.distributed as dist
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.plugins import load_general_plugins

    size, rank = dist.get_world_size(), dist.get_rank()
    if "config" not in _VLLM_STATE:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
        parallel = ParallelConfig(
            data_parallel_size=size,
            enable_expert_parallel=True,
            all2all_backend="deepep_high_throughput",
            distributed_executor_backend="external_launcher",
        )
        config = VllmConfig(parallel_config=parallel)
        with set_current_vllm_config(config):
            init_distributed_environment(world_size=size, rank=rank, local_rank=rank, backend="gloo")
            initialize_model_parallel(1, 1)
            load_general_plugins()  # vLLM's loader: runs moe_sbo's entry point (MOE_SBO_VLLM=1 here)
        alias = sys.modules.get("deep_ep")
        _VLLM_STATE["entry_point_ran"] = alias is not None and alias.__name__ == "moe_sbo.engines.vllm.deep_ep_alias"
        _VLLM_STATE["config"] = config
    config = _VLLM_STATE["config"]
    config.parallel_config.all2all_backend = backend
    return config


def _set_plugin(mode: str, dispatcher: str = "alltoall", overlap: str = "combine") -> None:
    from moe_sbo.engines.vllm import selection
    from moe_sbo.engines.vllm.settings import read_settings

    os.environ.update(MOE_SBO_VLLM_MODE=mode, MOE_SBO_VLLM_DISPATCHER=dispatcher, MOE_SBO_VLLM_OVERLAP=overlap)
    selection.install(read_settings())


def _run_kernel(prepare_finalize, experts_cls, x, ids, weights, rank, size, w1, w2, config):
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    import vllm_moe as vm
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    local = EXPERTS // size
    w1_local, w2_local = w1[rank * local : (rank + 1) * local], w2[rank * local : (rank + 1) * local]
    if prepare_finalize.activation_format == mk.FusedMoEActivationFormat.BatchedExperts:
        experts = experts_cls(
            config,
            FUSED_MOE_UNQUANTIZED_CONFIG,
            max_num_tokens=prepare_finalize.max_num_tokens_per_rank(),
            num_dispatchers=prepare_finalize.num_dispatchers(),
        )
    else:
        experts = experts_cls(config, FUSED_MOE_UNQUANTIZED_CONFIG)
    kernel = mk.FusedMoEKernel(prepare_finalize, experts)
    emap = vm.expert_map(EXPERTS, size, rank)
    with torch.no_grad():
        return kernel.apply(x, w1_local, w2_local, weights, ids, MoEActivation.SILU, EXPERTS, emap, False)


def _inputs(rank, dtype, hidden=HIDDEN):
    import vllm_moe as vm

    x, ids, weights = vm.routed_input(rank, TOKENS, hidden, EXPERTS, TOP_K, dtype)
    w1, w2 = vm.weights(EXPERTS, hidden, INTER, dtype)
    ref = vm.reference(x, ids, weights, w1, w2, TOP_K, INTER)
    return x, ids, weights, w1, w2, ref


def _rel_err(y, ref) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def selection_rank(device, backend: str, mode: str, dtype_name: str) -> dict:
    """vLLM's selection with its own DeepEP manager -> the prepare/finalize it built -> one forward."""
    import torch.distributed as dist
    import vllm_moe as vm
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_ep_group
    from vllm.distributed.device_communicators.all2all import DeepEPHTAll2AllManager, DeepEPLLAll2AllManager
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    dtype = getattr(torch, dtype_name)
    size, rank = dist.get_world_size(), dist.get_rank()
    vllm_config = _vllm_state(backend)
    hidden = LL_HIDDEN if backend == "deepep_low_latency" else HIDDEN
    with set_current_vllm_config(vllm_config):
        _set_plugin(mode)
        cpu_group = get_ep_group().cpu_group
        manager_cls = DeepEPLLAll2AllManager if backend == "deepep_low_latency" else DeepEPHTAll2AllManager
        manager = manager_cls(cpu_group)
        config = vm.moe_config(EXPERTS, TOP_K, hidden, INTER, dtype, size, rank, backend=backend, max_num_tokens=8)
        pf = all2all_utils.maybe_make_prepare_finalize(
            config, FUSED_MOE_UNQUANTIZED_CONFIG, allow_new_interface=True, all2all_manager=manager
        )
        rounded = all2all_utils.maybe_roundup_layer_hidden_size(hidden, dtype, config.moe_parallel_config)
        x, ids, weights, w1, w2, ref = _inputs(rank, dtype, hidden)
        experts = vm.TorchBatchedExperts if backend == "deepep_low_latency" else vm.TorchExperts
        y = _run_kernel(pf, experts, x, ids, weights, rank, size, w1, w2, config)
        buffer = getattr(pf, "buffer", None)
        group = buffer.group if buffer is not None else pf.group
        on_device_group = group is get_ep_group().device_group
    return {
        "entry_point_ran": _VLLM_STATE["entry_point_ran"],
        "on_device_group": on_device_group,
        "class": type(pf).__name__,
        "buffer": f"{type(buffer).__module__}.{type(buffer).__name__}" if buffer is not None else None,
        "rounded": rounded,
        "err": _rel_err(y, ref),
    }


def native_rank(
    device, dispatcher: str, dtype_name: str, ranks_per_node: int | None, overlap: str = "combine"
) -> float:
    """MoeSboPrepareAndFinalize on ``dispatcher`` in vLLM's FusedMoEKernel vs vLLM's one-rank reference."""
    import torch.distributed as dist
    import vllm_moe as vm

    from moe_sbo.engines.vllm.prepare_finalize import DispatcherRecipe, MoeSboPrepareAndFinalize

    dtype = getattr(torch, dtype_name)
    size, rank = dist.get_world_size(), dist.get_rank()
    previous = os.environ.pop("MOE_SBO_RANKS_PER_NODE", None)
    if ranks_per_node is not None:
        os.environ["MOE_SBO_RANKS_PER_NODE"] = str(ranks_per_node)
    try:
        recipe = DispatcherRecipe(dispatcher, dist.group.WORLD, max_tokens_per_rank=TOKENS)
        pf = MoeSboPrepareAndFinalize(recipe, overlap=overlap)
        config = vm.moe_config(EXPERTS, TOP_K, HIDDEN, INTER, dtype, size, rank)
        x, ids, weights, w1, w2, ref = _inputs(rank, dtype)
        y = _run_kernel(pf, vm.TorchExperts, x, ids, weights, rank, size, w1, w2, config)
        assert ranks_per_node is None or pf.dispatcher.ep.node_size == ranks_per_node
    finally:
        os.environ.pop("MOE_SBO_RANKS_PER_NODE", None)
        if previous is not None:
            os.environ["MOE_SBO_RANKS_PER_NODE"] = previous
    return _rel_err(y, ref)


def sbo_rank(device, dispatcher: str) -> dict:
    """Every moe-sbo SBO mode, shared experts inside the prepare/finalize, through vLLM's kernel:
    the outputs (routed + shared) and the hook events one forward fired."""
    import torch.distributed as dist
    import vllm_moe as vm

    from moe_sbo.engines.vllm.prepare_finalize import DispatcherRecipe, MoeSboPrepareAndFinalize
    from moe_sbo.experts.shared import SharedExperts
    from moe_sbo.overlap import FIXED_MODES

    size, rank = dist.get_world_size(), dist.get_rank()
    shared = SharedExperts(HIDDEN, 48)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in shared.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 8)
    config = vm.moe_config(EXPERTS, TOP_K, HIDDEN, INTER, torch.float32, size, rank)
    x, ids, weights, w1, w2, ref = _inputs(rank, torch.float32)
    outputs, events = {}, {}
    for mode in FIXED_MODES:
        pf = MoeSboPrepareAndFinalize(
            DispatcherRecipe(dispatcher, dist.group.WORLD, max_tokens_per_rank=TOKENS), overlap=mode, shared=shared
        )
        seen: list[str] = []
        for event in HOOK_EVENTS:
            pf.hooks.register(event, lambda d, payload, event=event: seen.append(event))
        outputs[mode] = _run_kernel(pf, vm.TorchExperts, x, ids, weights, rank, size, w1, w2, config)
        events[mode] = seen
    with torch.no_grad():
        expected = ref + shared(x)
    return {
        "bitwise": {m: torch.equal(y, outputs["none"]) for m, y in outputs.items()},
        "err": _rel_err(outputs["none"], expected),
        "events": events,
        "scopes_left": sum(pf.hooks.count(e) for e in HOOK_EVENTS) - len(HOOK_EVENTS),
    }


def vllm_shared_rank(device, overlap: str) -> dict:
    """vLLM's own ``SharedExperts`` handed to ``FusedMoEKernel.apply``: the moe-sbo events that had
    fired when vLLM ran them, and the routed + shared output against the reference."""
    import torch.distributed as dist
    import vllm_moe as vm
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts as VllmSharedExperts

    from moe_sbo.engines.vllm.prepare_finalize import DispatcherRecipe, MoeSboPrepareAndFinalize
    from moe_sbo.experts.shared import SharedExperts

    size, rank = dist.get_world_size(), dist.get_rank()
    vllm_config = _vllm_state("deepep_high_throughput")
    pf = MoeSboPrepareAndFinalize(DispatcherRecipe("alltoall", dist.group.WORLD), overlap=overlap)
    fired: list[str] = []
    for event in HOOK_EVENTS:
        pf.hooks.register(event, lambda d, payload, event=event: fired.append(event))
    seen_when_run: list[list[str]] = []

    class Mlp(SharedExperts):
        def forward(self, x_TH):
            seen_when_run.append(list(fired))
            return super().forward(x_TH)

    mlp = Mlp(HIDDEN, 48)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 8)
    config = vm.moe_config(EXPERTS, TOP_K, HIDDEN, INTER, torch.float32, size, rank)
    with set_current_vllm_config(vllm_config):
        shared = VllmSharedExperts(mlp, config, enable_dbo=False, mk_can_overlap_shared_experts=lambda: True)
        x, ids, weights, w1, w2, ref = _inputs(rank, torch.float32)
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

        local = EXPERTS // size
        kernel = mk.FusedMoEKernel(pf, vm.TorchExperts(config, FUSED_MOE_UNQUANTIZED_CONFIG))
        with torch.no_grad():
            routed = kernel.apply(
                x, w1[rank * local : (rank + 1) * local], w2[rank * local : (rank + 1) * local], weights, ids,
                MoEActivation.SILU, EXPERTS, vm.expert_map(EXPERTS, size, rank), False,
                shared_experts=shared, shared_experts_input=x,
            )  # fmt: skip
            out = routed + shared.output
            expected = ref + SharedExperts.forward(mlp, x)  # not counted as vLLM's call
    return {"seen": seen_when_run, "err": _rel_err(out, expected)}


# ---- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_vllm_selection_returns_moe_sbo_prepare_finalize(vllm_ranks, world):
    for dtype in ("float32", "bfloat16"):
        for r in vllm_ranks(world).run(selection_rank, "deepep_high_throughput", "native", dtype):
            assert r["entry_point_ran"]  # vLLM's load_general_plugins ran moe_sbo's entry point
            assert r["class"] == "MoeSboPrepareAndFinalize"
            assert r["on_device_group"]  # not the CPU group vLLM hands DeepEP
            assert r["rounded"] == HIDDEN  # moe-sbo moves rows of any width: vLLM's round-up leaves it
            assert r["err"] <= TOLERANCE[getattr(torch, dtype)], (world, dtype, r)


@pytest.mark.parametrize("world", [2, 4])
def test_vllm_deep_ep_classes_run_on_moe_sbo_deep_ep(vllm_ranks, world):
    cases = [
        ("deepep_high_throughput", "bfloat16"),  # vLLM's HT class combines bf16 only
        ("deepep_low_latency", "float32"),
        ("deepep_low_latency", "bfloat16"),
    ]
    for backend, dtype in cases:
        for r in vllm_ranks(world).run(selection_rank, backend, "deep_ep", dtype):
            expected = "DeepEPLLPrepareAndFinalize" if backend == "deepep_low_latency" else "DeepEPHTPrepareAndFinalize"
            assert r["class"] == expected
            assert r["buffer"] == "moe_sbo.engines.vllm.deep_ep_alias.Buffer"
            assert r["on_device_group"]
            assert r["err"] <= TOLERANCE[getattr(torch, dtype)], (world, backend, dtype, r)


@pytest.mark.parametrize("world", [2, 4])
def test_every_dispatcher_in_vllm_kernel_equals_reference(vllm_ranks, world):
    cases = [(d, None) for d in ("alltoall", "allgather", "low_latency", "node_aware")]
    if world == 4:
        cases.append(("node_aware", 2))  # 2 nodes x 2 ranks
    for dispatcher, ranks_per_node in cases:
        for dtype in ("float32", "bfloat16"):
            errors = vllm_ranks(world).run(native_rank, dispatcher, dtype, ranks_per_node)
            assert max(errors) <= TOLERANCE[getattr(torch, dtype)], (world, dispatcher, ranks_per_node, dtype, errors)
    # The combine finished inside finalize_async (vLLM's shared experts then run after it).
    assert max(vllm_ranks(world).run(native_rank, "alltoall", "float32", None, "none")) <= 1e-5


@pytest.mark.parametrize("dispatcher", ["alltoall", "low_latency"])
def test_sbo_modes_equal_none_bitwise_through_vllm_kernel(vllm_ranks, dispatcher):
    for r in vllm_ranks(2).run(sbo_rank, dispatcher):
        assert all(r["bitwise"].values()), r["bitwise"]
        assert r["err"] <= 1e-5
        for mode, events in r["events"].items():
            assert events == list(HOOK_EVENTS), (mode, events)
        assert r["scopes_left"] == 0  # each forward's SBO hooks are gone after it


def test_refusals_name_the_problem():
    from moe_sbo.dispatch import EPGroup, make_dispatcher
    from moe_sbo.engines.vllm.prepare_finalize import DispatcherRecipe, MoeSboPrepareAndFinalize

    one_rank = make_dispatcher("alltoall", EXPERTS, EPGroup())
    with pytest.raises(ValueError, match="need them passed as shared="):
        MoeSboPrepareAndFinalize(one_rank, overlap="dispatch")
    with pytest.raises(ValueError, match="dispatcher must be one of"):
        DispatcherRecipe("local", None)
    with pytest.raises(ValueError, match="low_latency dispatcher needs max_tokens_per_rank"):
        DispatcherRecipe("low_latency", None)
    with pytest.raises(RuntimeError, match="finalize ran without a prepare"):
        MoeSboPrepareAndFinalize(one_rank).finalize(None, torch.zeros(1, 4), None, None, False, None)


@pytest.mark.parametrize(("overlap", "before"), [("combine", 5), ("none", 6)])
def test_vllm_shared_experts_run_where_overlap_says(vllm_ranks, overlap, before):
    """vLLM calls its shared experts between finalize_async and its hook: moe-sbo's combine is then in
    flight (``combine``: the first five events have fired) or finished (``none``: all six)."""
    for r in vllm_ranks(2).run(vllm_shared_rank, overlap):
        assert r["seen"] == [list(HOOK_EVENTS[:before])], r["seen"]
        assert r["err"] <= 1e-5
