"""SGLang 0.5.23's own runtime on a gloo CPU rank, as its scheduler process builds it, for the tests of
moe-sbo's SGLang plugin: ``load_plugins`` (the entry point), ``ServerArgs`` + ``publish`` (the config
bags), ``init_distributed_environment`` + ``initialize_model_parallel`` over gloo (SGLang's TP/EP
groups on the rank group ``LocalRanks`` made), ``initialize_moe_config``; then ``create_moe_dispatcher``,
the factory SGLang's ``FusedMoE`` calls, with the plugin's hook around it.

What stands apart from a server here, and why:

- torchvision: PyPI's torchvision wheels are CUDA builds; on a CPU torch their ops do not load and
  torchvision 0.28 then fails at import registering fake kernels for ``torchvision::nms`` / ``qnms``.
  Only when its extension cannot load, ``cpu_torchvision`` defines those two schemas (no kernel) so
  the import SGLang's config package makes (``torchvision.transforms``) succeeds; nothing here calls them.
- ``deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM``: SGLang's own normal-mode DeepEP combine raises
  ``NotImplementedError`` unless DeepGEMM (or AITER, or an NPU) is on (its Triton path is disabled in
  0.5.23); ``sglang_deep_gemm_path`` sets the flag around SGLang's dispatcher so that code runs. Nothing
  of DeepGEMM runs: the dispatch dtype is bf16 or float32, so no fp8 quantisation is asked for.
- The experts are plain float32 SwiGLU experts in the test (SGLang's MoE runners are CUDA kernels);
  the dispatcher path between them is SGLang's and moe-sbo's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

_ready: dict[str, int] = {}


def cpu_torchvision() -> None:
    """Let torchvision import on a CPU torch when its (CUDA-built) extension cannot load (see above)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None or hasattr(torch.ops.torchvision, "nms"):
        return
    extension = next(Path(spec.origin).parent.glob("_C*.so"), None)
    try:
        if extension is not None:
            torch.ops.load_library(str(extension))
            return
    except OSError:
        pass
    for op in ("nms", "qnms"):
        torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def ensure(deepep_mode: str = "auto") -> None:
    """SGLang's runtime on this rank (once per rank process), its deepep mode set to ``deepep_mode``."""
    cpu_torchvision()
    os.environ["MOE_SBO_SGLANG"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the config is local; never ask the hub
    world = dist.get_world_size()
    if _ready.get("world") != world:
        from sglang.srt import runtime_context as rc
        from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
        from sglang.srt.layers.moe.utils import initialize_moe_config
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        from sglang.srt.server_args import ServerArgs

        load_plugins()
        unapplied = set(plugin_targets()) - HookRegistry._patched
        if unapplied:  # SGLang logs why and goes on; a test must not
            raise RuntimeError(f"SGLang did not apply the plugin's hooks to {sorted(unapplied)}; its log says why")
        server_args = ServerArgs(
            model_path=str(model_dir()),  # its config.json is read; no model is built here
            device="cpu",
            tp_size=world,
            ep_size=world,
            moe_a2a_backend="deepep",
            deepep_mode="auto",
            deepep_dispatcher_output_dtype="bf16",
        )
        rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=dist.get_rank()))
        init_distributed_environment(
            backend="gloo", world_size=world, rank=dist.get_rank(), local_rank=-1, distributed_init_method="env://"
        )
        initialize_model_parallel()
        initialize_moe_config()
        _ready["world"] = world
    from sglang.srt.layers.moe.utils import DeepEPMode
    from sglang.srt.runtime_context import get_flags

    get_flags().moe.deepep_mode = DeepEPMode(deepep_mode)


# A DeepSeek-V3-shaped config, tiny: SGLang's argument resolution reads the model's config.json.
TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
}


def model_dir() -> Path:
    """A directory holding ``TINY_DEEPSEEK_V3`` as config.json (one per rank process)."""
    path = Path(tempfile.mkdtemp(prefix="moe-sbo-sglang-"))
    (path / "config.json").write_text(json.dumps(TINY_DEEPSEEK_V3))
    return path


def plugin_targets() -> list[str]:
    """What the plugin hooks in SGLang when it is on."""
    from moe_sbo.engines.sglang import plugin

    names = [f"{plugin.SBO_FLAGS}.{name}" for name in plugin.SBO_FLAG_ANSWERS]
    return [plugin.CREATE_MOE_DISPATCHER, plugin.GET_DEEPEP_BUFFER, *names]


@contextlib.contextmanager
def plugin_choice(dispatcher: str, overlap: str | None, ranks_per_node: int | None) -> Iterator[None]:
    """The plugin's settings for one test (its variables, read at ``create_moe_dispatcher``), and a fresh
    process buffer (``MOE_SBO_RANKS_PER_NODE`` is read when the buffer is made)."""
    from sglang.srt.runtime_context import get_resources

    saved = {
        k: os.environ.get(k) for k in ("MOE_SBO_SGLANG_DISPATCHER", "MOE_SBO_SGLANG_OVERLAP", "MOE_SBO_RANKS_PER_NODE")
    }
    os.environ["MOE_SBO_SGLANG_DISPATCHER"] = dispatcher
    _set("MOE_SBO_SGLANG_OVERLAP", overlap)
    _set("MOE_SBO_RANKS_PER_NODE", None if ranks_per_node is None else str(ranks_per_node))
    get_resources().buffers.pop("deepep_ep_state", None)
    try:
        yield
    finally:
        get_resources().buffers.pop("deepep_ep_state", None)
        for key, value in saved.items():
            _set(key, value)


def _set(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


@contextlib.contextmanager
def sglang_deep_gemm_path() -> Iterator[None]:
    """SGLang's normal-mode DeepEP combine runs only under this flag (see the module docstring)."""
    from sglang.srt.layers import deep_gemm_wrapper

    saved = deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM
    deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True
    try:
        yield
    finally:
        deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = saved


def create_dispatcher(num_experts: int, hidden: int, top_k: int, dtype: torch.dtype):
    """SGLang's ``create_moe_dispatcher`` (the plugin's hook around it) for one MoE layer's shape."""
    from sglang.srt.layers.moe import MoeRunnerConfig
    from sglang.srt.layers.moe.fused_moe_triton.layer import create_moe_dispatcher

    config = MoeRunnerConfig(
        num_experts=num_experts,
        num_local_experts=num_experts // dist.get_world_size(),
        hidden_size=hidden,
        intermediate_size_per_partition=2 * hidden,
        top_k=top_k,
        params_dtype=dtype,
    )
    return create_moe_dispatcher(config, quant_method=None)
