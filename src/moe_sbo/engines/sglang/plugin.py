"""The ``sglang.srt.plugins`` entry point (``pyproject.toml``: ``moe_sbo = moe_sbo.engines.sglang.plugin:register``).

SGLang calls ``register()`` early in every process (``load_plugins``), then applies the hooks it
registered (``sglang.srt.plugins.hook_registry.HookRegistry.apply_hooks``). With ``MOE_SBO_SGLANG=1``
(``settings.py``) it registers:

- ``create_moe_dispatcher`` (AROUND): for ``--moe-a2a-backend deepep``, SGLang's own DeepEP dispatcher
  on ``moe_sbo.deep_ep.Buffer`` (``MOE_SBO_SGLANG_DISPATCHER=deep_ep``, the default), or moe-sbo's
  dispatcher class (``moe_sbo``: ``tbo.MoeSboTboDispatcher``);
- ``DeepEPBuffer.get_deepep_buffer`` (AROUND): the process's buffer is moe-sbo's (``buffer.py``);
- ``SboFlags``' three placement questions (AROUND): with moe-sbo's dispatcher and an SBO mode
  (``MOE_SBO_SGLANG_OVERLAP``), SGLang's DeepSeek model hands its shared experts to
  ``register_deepep_dispatch_hook`` and asks for none of DeepEP's combine signals, so the mode, not
  ``--enable-single-batch-overlap``, places them: SGLang 0.5.23 refuses that flag on SM90 GPUs, and
  moe-sbo's modes run there.

Without ``MOE_SBO_SGLANG=1`` it registers nothing: the plugin is installed and SGLang runs unchanged.
The settings are read again at each ``create_moe_dispatcher`` call (model load), so every layer of
one process gets the same dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import settings

CREATE_MOE_DISPATCHER = "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher"
GET_DEEPEP_BUFFER = "sglang.srt.layers.moe.token_dispatcher.deepep.DeepEPBuffer.get_deepep_buffer"
SBO_FLAGS = "sglang.srt.batch_overlap.single_batch_overlap.SboFlags"
# SboFlags' answers while moe-sbo's dispatcher places the shared experts by an SBO mode.
SBO_FLAG_ANSWERS = {
    "enable_dispatch_shared_one_stream_overlap": True,  # the model registers its shared experts
    "enable_combine_shared_two_stream_overlap": False,
    "enable_combine_down_gemm_two_stream_overlap": False,  # DeepEP's down-GEMM signals: none here
}


def register() -> None:
    """Register the hooks above when ``MOE_SBO_SGLANG=1``; otherwise do nothing."""
    if not settings.from_environ().enabled:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import buffer

    buffer.install()
    HookRegistry.register(CREATE_MOE_DISPATCHER, create_moe_dispatcher, HookType.AROUND)
    HookRegistry.register(GET_DEEPEP_BUFFER, buffer.get_deepep_buffer, HookType.AROUND)
    for name, answer in SBO_FLAG_ANSWERS.items():
        HookRegistry.register(f"{SBO_FLAGS}.{name}", _sbo_flag(answer), HookType.AROUND)


def create_moe_dispatcher(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """SGLang's ``create_moe_dispatcher(moe_runner_config, quant_method)`` with moe-sbo for ``deepep``."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.moe import get_deepep_mode, get_moe_a2a_backend
    from sglang.srt.runtime_context import get_parallel

    from . import buffer

    chosen = settings.from_environ()
    if not get_moe_a2a_backend().is_deepep():
        return original(*args, **kwargs)
    buffer.install()
    if chosen.dispatcher == "deep_ep":
        return original(*args, **kwargs)
    from .tbo import MoeSboTboDispatcher

    config = kwargs["moe_runner_config"] if "moe_runner_config" in kwargs else args[0]
    return MoeSboTboDispatcher(
        group=get_parallel().tp_group.device_group,  # the group SGLang gives DeepEP
        router_topk=config.top_k,
        num_experts=config.num_experts,
        num_local_experts=config.num_local_experts,
        hidden_size=config.hidden_size,
        params_dtype=config.params_dtype,
        deepep_mode=get_deepep_mode(),
        num_max_dispatch_tokens_per_rank=envs.SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK.get(),
        overlap=chosen.overlap,
        runner_backend=config.runner_backend,
    )


def _sbo_flag(answer: bool) -> Callable[..., bool]:
    """An AROUND hook for one ``SboFlags`` classmethod: ``answer`` while moe-sbo's dispatcher has an SBO
    mode, SGLang's own answer otherwise."""

    def flag(original: Callable[..., bool], *args: Any, **kwargs: Any) -> bool:
        chosen = settings.from_environ()
        if chosen.dispatcher == "moe_sbo" and chosen.overlap is not None:
            return answer
        return original(*args, **kwargs)

    return flag
