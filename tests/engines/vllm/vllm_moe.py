"""What the vLLM tests build on: vLLM's MoE config, experts that run on CPU, and the single-rank
reference, each through vLLM's own classes.

vLLM's CPU experts and its SiLU-and-mul need its compiled ``_C`` ops, which its CUDA wheel cannot
load without CUDA; these experts are the one piece written here. ``TorchExperts`` is vLLM's
``FusedMoEExpertsModular`` (standard format) in plain torch; ``TorchBatchedExperts`` is vLLM's own
``NaiveBatchedExperts`` (batched format, for the DeepEP low-latency class) with ``apply`` in
torch. The reference is vLLM's single-rank path: ``FusedMoEKernel`` with vLLM's no-DP/EP
prepare/finalize and every expert on the one rank.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform (its CUDA wheel, no GPU here)

import torch
import torch.nn.functional as F
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
)
from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import NaiveBatchedExperts
from vllm.model_executor.layers.fused_moe.prepare_finalize import make_moe_prepare_and_finalize_no_dp_ep
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP


def parallel_config(ep_size: int, ep_rank: int, backend: str) -> FusedMoEParallelConfig:
    """vLLM's MoE parallel config of DP = EP = ``ep_size`` (TP 1), as ``--data-parallel-size N
    --enable-expert-parallel --all2all-backend <backend>`` makes it."""
    return FusedMoEParallelConfig(
        tp_size=1,
        pcp_size=1,
        dp_size=ep_size,
        ep_size=ep_size,
        tp_rank=0,
        pcp_rank=0,
        dp_rank=ep_rank,
        ep_rank=ep_rank,
        sp_size=1,
        use_ep=ep_size > 1,
        all2all_backend=backend,
        enable_eplb=False,
    )


def moe_config(
    num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, ep_size: int, ep_rank: int,
    backend: str = "deepep_high_throughput", max_num_tokens: int = 64,
) -> FusedMoEConfig:  # fmt: skip
    """vLLM's ``FusedMoEConfig`` of one layer on rank ``ep_rank`` of ``ep_size``."""
    return FusedMoEConfig(
        num_experts=num_experts,
        experts_per_token=top_k,
        hidden_dim=hidden,
        intermediate_size=inter,
        num_local_experts=num_experts // ep_size,
        num_logical_experts=num_experts,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.TopK,
        moe_parallel_config=parallel_config(ep_size, ep_rank, backend),
        in_dtype=dtype,
        max_num_tokens=max_num_tokens,
    )


def _swiglu_expert(x_XH: torch.Tensor, w1_2IH: torch.Tensor, w2_HI: torch.Tensor) -> torch.Tensor:
    gate, up = (x_XH.float() @ w1_2IH.float().t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2_HI.float().t()


class TorchExperts(mk.FusedMoEExpertsModular):
    """vLLM's standard-format experts interface in plain torch: each row's top-k experts (global ids,
    made local by ``expert_map``; -1 there means another rank's), SwiGLU, weighted and summed in
    float32 over k in order. It reduces itself (``TopKWeightAndReduceNoOP``), as vLLM's Triton experts do."""

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return weight_key is None and activation_key is None

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return True

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        return (0,), (0,), (M, K)

    def apply(
        self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
        a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta, apply_router_weight_on_input,
    ):  # fmt: skip
        ids_MK = topk_ids.long()
        if expert_map is not None:
            ids_MK = expert_map[ids_MK].long()
        acc_MH = torch.zeros(hidden_states.shape[0], w2.shape[1], dtype=torch.float32)
        for k in range(ids_MK.shape[1]):
            for expert in range(w1.shape[0]):
                rows = (ids_MK[:, k] == expert).nonzero().flatten()
                if rows.numel():
                    y = _swiglu_expert(hidden_states[rows], w1[expert], w2[expert])
                    acc_MH[rows] += y * topk_weights[rows, k, None].float()
        output.copy_(acc_MH.reshape(output.shape))


class TorchBatchedExperts(NaiveBatchedExperts):
    """vLLM's ``NaiveBatchedExperts`` (batched format: [L, max tokens, H] and per-expert counts) with
    its ``apply`` in plain torch: vLLM's asks ``torch.accelerator`` whether a graph is capturing,
    which raises without an accelerator, and its SiLU-and-mul is a compiled op."""

    def apply(
        self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
        a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta, apply_router_weight_on_input,
    ):  # fmt: skip
        counts = expert_tokens_meta.expert_num_tokens.tolist()
        for expert, num in enumerate(counts):
            if num:
                y = _swiglu_expert(hidden_states[expert, :num], w1[expert], w2[expert])
                output[expert, :num] = y.to(output.dtype)


def weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's expert weights for every expert, the same on every rank: w1 [E, 2I, H], w2 [E, H, I]."""
    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w1.to(dtype), w2.to(dtype)


def routed_input(rank: int, tokens: int, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype):
    """Rank ``rank``'s tokens: x [T, H], topk_ids [T, K] (distinct experts), topk_weights [T, K] float32."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    return x, ids, topk_weights


def reference(x, ids, topk_weights, w1, w2, top_k: int, inter: int) -> torch.Tensor:
    """vLLM's single-rank path: ``FusedMoEKernel`` with the no-DP/EP prepare/finalize, all experts here."""
    config = moe_config(w1.shape[0], top_k, x.shape[1], inter, x.dtype, ep_size=1, ep_rank=0)
    kernel = mk.FusedMoEKernel(
        make_moe_prepare_and_finalize_no_dp_ep(use_monolithic=False),
        TorchExperts(config, FUSED_MOE_UNQUANTIZED_CONFIG),
    )
    return kernel.apply(x, w1, w2, topk_weights, ids, MoEActivation.SILU, w1.shape[0], None, False)


def expert_map(num_experts: int, ep_size: int, ep_rank: int) -> torch.Tensor:
    """vLLM's expert map of rank ``ep_rank``: global id -> local id, -1 for other ranks' experts."""
    local = num_experts // ep_size
    out = torch.full((num_experts,), -1, dtype=torch.int32)
    out[ep_rank * local : (ep_rank + 1) * local] = torch.arange(local, dtype=torch.int32)
    return out
