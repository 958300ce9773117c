"""``low_latency``: DeepEP low-latency style. Fixed-capacity buffers, counts that never leave the
device, no host synchronisation: a whole MoE forward can be captured in a CUDA graph.

Legend: T tokens on this rank (T <= C), C ``max_tokens_per_rank`` (the capacity), P ranks, S = P * C
slots, K top-k, L local experts, H hidden, G = H / 128 fp8 scale groups, B bytes of one packed row,
R = S * K expert rows (fixed: every (slot, k) pair has one, real ones first).

Wire format: one fixed-size block per (rank, peer) and phase, moved by one ``all_to_all_single``
(``transport="nccl"``) or written by the packing kernel straight into the peer's symmetric-memory
receive buffer (``"symm_mem"``, the CUDA default from two GPUs)::

    dispatch  send [P, C, B] uint8. Block p holds, in its first rows, each token with at least one
              expert on rank p, once (rank-deduplicated), in token order; the rest of the block is
              the padding row (x zero, ids -1). A row packs x (activation dtype, or fp8 e4m3 plus
              G float32 scales), the K global expert ids (int32) and the K weights (float32).
    combine   send [P, C, H] activation dtype. Row c of block p: this rank's weighted sum of its
              experts' outputs for slot c of what rank p sent; the token's rank sums its P rows.

Every shape depends on C, P, K, H only, so nothing is sized from data and nothing is read on the
host. The bytes on the wire are the full blocks whatever the routing: (P - 1) * C * B per dispatch
and (P - 1) * C * H * elem per combine for each rank (its block to itself stays local).

The hard part is the receiver's layout. Grouped GEMM needs rows grouped by expert, but the number
of rows per expert is data: a fixed R = S * K rows are laid out expert-major with the real rows
first and the per-expert counts on the device; ``torch._grouped_mm`` (offsets = cumsum(counts))
computes only rows below the last offset, so the padding tail costs a gather but no GEMM work.
The alternative, a padded ``[L, S, H]`` layout with counts = S per expert, would make the GEMM run
on L * S rows (L times the real work at decode, all of it padding); we take the gather instead. The
padding rows' expert outputs are undefined (grouped GEMM leaves them unwritten), so combine masks
them rather than multiplying by a zero weight (0 * NaN is NaN). On the torch path the receiver's
gather and combine's reduction still touch all R rows, about P times the real ones under balanced
routing; the fused kernels (``ll_kernels.py``, the CUDA default) read the device count and skip them.

Ids may be -1: "no expert" (a padding token; ``mask_padding_tokens`` makes a capacity-sized input
whose real count is a device tensor). Other out-of-range ids are checked without a host read: a
device-side assert on CUDA (loud and fatal, never a silent drop), a plain check on CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import env
from ..hooks import HookFn
from .base import (CombineInput, DispatchHandle, DispatchInput, DispatchOutput, Dispatcher, EPGroup, Pending,
                   Traffic, register_dispatcher)
from .layout import ExpertLayout
from .reduce import gather_sum, interpreting_triton

try:  # Triton comes with CUDA builds of torch; without it the torch reference path runs
    from . import ll_kernels
except ImportError:  # pragma: no cover - depends on the environment
    ll_kernels = None

FP8_GROUP = 128  # values sharing one fp8 scale, as DeepEP's low-latency dispatch
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


# ---- fp8 ---------------------------------------------------------------------------------------------


def quantize_fp8(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_TH`` [T, H] (H a multiple of 128) -> (``q_TH`` e4m3 [T, H], ``scales_TG`` float32 [T, G]).

    One scale per token and 128 consecutive values: amax / 448, so x ~= q * scale with e4m3's 3
    mantissa bits: relative error <= 2^-4 down to amax * 2^-6 / 448 (e4m3's smallest normal), below
    that an absolute error <= scale * 2^-10.
    """
    num_tokens, hidden = x_TH.shape
    x_TGV = x_TH.float().view(num_tokens, hidden // FP8_GROUP, FP8_GROUP)
    # The floor keeps an all-zero group finite (0 / 0 would be NaN); it is far below any real amax.
    scales_TG1 = x_TGV.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / FP8_MAX
    # Clamp: amax / scale can round a hair above 448, and e4m3fn has no inf (it would become NaN).
    q_TGV = (x_TGV / scales_TG1).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q_TGV.view(num_tokens, hidden), scales_TG1.view(num_tokens, hidden // FP8_GROUP)


def dequantize_fp8(q_NH: torch.Tensor, scales_NG: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_fp8``: ``[N, H]`` in ``dtype``."""
    num_rows, hidden = q_NH.shape
    x_NGV = q_NH.float().view(num_rows, hidden // FP8_GROUP, FP8_GROUP) * scales_NG[:, :, None]
    return x_NGV.view(num_rows, hidden).to(dtype)


# ---- the packed row ----------------------------------------------------------------------------------


def _align(nbytes: int, to: int) -> int:
    return -(-nbytes // to) * to


@dataclass(frozen=True)
class RowFormat:
    """Byte layout of one dispatch row: x (or fp8 x and its scales), ids, weights.

    Each part starts on a 4-byte boundary so it can be viewed in place as its dtype; rows are padded
    to 16 bytes so copies stay vectorised.
    """

    hidden: int
    top_k: int
    dtype: torch.dtype  # the activation dtype (what the receiver gets back)
    fp8: bool
    scales_offset: int
    ids_offset: int
    weights_offset: int
    row_bytes: int

    @classmethod
    def make(cls, hidden: int, top_k: int, dtype: torch.dtype, fp8: bool) -> "RowFormat":
        x_bytes = hidden * (1 if fp8 else dtype.itemsize)
        scales_offset = _align(x_bytes, 4)
        ids_offset = scales_offset + (4 * hidden // FP8_GROUP if fp8 else 0)
        weights_offset = ids_offset + 4 * top_k
        return cls(hidden, top_k, dtype, fp8, scales_offset, ids_offset, weights_offset,
                   _align(weights_offset + 4 * top_k, 16))

    def _part(self, rows_NB: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return rows_NB[:, offset:offset + nbytes].view(dtype)

    def ids(self, rows_NB: torch.Tensor) -> torch.Tensor:
        """int32 ``[N, K]`` view of the rows' global expert ids."""
        return self._part(rows_NB, self.ids_offset, 4 * self.top_k, torch.int32)

    def weights(self, rows_NB: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, K]`` view of the rows' top-k weights."""
        return self._part(rows_NB, self.weights_offset, 4 * self.top_k, torch.float32)

    def x(self, rows_NB: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` activations in ``dtype``: a view, or a dequantised copy for fp8."""
        if not self.fp8:
            return self._part(rows_NB, 0, self.hidden * self.dtype.itemsize, self.dtype)
        scales_NG = self._part(rows_NB, self.scales_offset, 4 * self.hidden // FP8_GROUP, torch.float32)
        return dequantize_fp8(self._part(rows_NB, 0, self.hidden, FP8_DTYPE), scales_NG, self.dtype)

    def pack(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """uint8 ``[T + 1, B]``: token t in row t, and row T the padding row (x zero, ids -1)."""
        num_tokens = x_TH.shape[0]
        rows = torch.zeros(num_tokens + 1, self.row_bytes, dtype=torch.uint8, device=x_TH.device)
        if self.fp8:
            q_TH, scales_TG = quantize_fp8(x_TH)
            self._part(rows, 0, self.hidden, FP8_DTYPE)[:num_tokens] = q_TH
            self._part(rows, self.scales_offset, 4 * scales_TG.shape[1], torch.float32)[:num_tokens] = scales_TG
        else:
            self._part(rows, 0, self.hidden * self.dtype.itemsize, self.dtype)[:num_tokens] = x_TH
        ids = self.ids(rows)
        ids[:num_tokens] = ids_TK
        ids[num_tokens] = -1
        self.weights(rows)[:num_tokens] = weights_TK
        return rows


# ---- index logic (pure functions, tested against hand-worked tensors) ---------------------------------


@dataclass(frozen=True)
class SendPlan:
    """Where each token goes. ``slot_TP`` int64 [T, P]: the slot ``p * C + row`` of token t in block p,
    or S when t has no expert on rank p. ``token_S`` int64 [S]: the token in each slot, or T (the
    padding row) for an empty slot."""

    slot_TP: torch.Tensor
    token_S: torch.Tensor


def plan_send(ids_TK: torch.Tensor, num_local_experts: int, num_ranks: int, capacity: int) -> SendPlan:
    """Rank-deduplicated placement of ``T <= capacity`` tokens into P blocks of ``capacity`` rows.

    Ids of -1 ("no expert") send nothing. All on the device, no host read: a token's row in block p
    is how many earlier tokens also go to p (a cumulative sum), so blocks keep token order.
    """
    num_tokens = ids_TK.shape[0]
    device = ids_TK.device
    num_slots = num_ranks * capacity
    ids_TK = ids_TK.long()
    # Column P collects "no expert", so scatter needs no mask; it is dropped after.
    owner_TK = torch.where(ids_TK >= 0, torch.div(ids_TK, num_local_experts, rounding_mode="floor"), num_ranks)
    is_sent_TP = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=device)
    is_sent_TP = is_sent_TP.scatter_(1, owner_TK, True)[:, :num_ranks]
    # Prefix sum along the contiguous dimension: a scan down few columns of many rows is sequential on CUDA.
    row_TP = (is_sent_TP.t().long().cumsum(dim=1) - 1).t()
    first_slot_P = torch.arange(num_ranks, device=device) * capacity
    slot_TP = torch.where(is_sent_TP, first_slot_P + row_TP, num_slots)
    # Slot S is scratch: every "not sent" (t, p) lands there, and it is cut off.
    token_S = torch.full((num_slots + 1,), num_tokens, dtype=torch.int64, device=device)
    token_TP = torch.arange(num_tokens, device=device)[:, None].expand(num_tokens, num_ranks)
    token_S.scatter_(0, slot_TP.reshape(-1), token_TP.reshape(-1))
    return SendPlan(slot_TP=slot_TP, token_S=token_S[:num_slots])


@dataclass(frozen=True)
class FixedLayout:
    """The receiver's expert-major layout of R = S * K rows, and its inverse for combine.

    ``layout.row_R``: slot of each expert row (S, the zero padding slot, for padding rows);
    ``layout.weight_R`` float32 (0 on padding rows); ``layout.num_rows_per_expert_L`` int64 real
    rows per local expert, on the device. ``pair_row_SK``: the expert row of pair (slot, k);
    ``pair_weight_SK`` float32 its weight, 0 where the pair is not a local expert's;
    ``is_local_SK`` bool.
    """

    layout: ExpertLayout
    pair_row_SK: torch.Tensor
    pair_weight_SK: torch.Tensor
    is_local_SK: torch.Tensor


def group_slots_by_expert(local_ids_SK: torch.Tensor, weights_SK: torch.Tensor,
                          num_local_experts: int) -> FixedLayout:
    """Every (slot, k) pair in expert order (stable: slot order inside an expert), real pairs first,
    pairs with local id -1 after them. Fixed shapes, no host read."""
    num_slots, k = local_ids_SK.shape
    device = local_ids_SK.device
    is_local_SK = local_ids_SK >= 0
    # Non-local pairs get key L: a counting sort puts them after every expert's rows.
    key_N = torch.where(is_local_SK, local_ids_SK.long(), num_local_experts).reshape(-1)
    # Counting sort by one-hot prefix sums, not torch.sort: at decode sizes a radix sort of a few
    # thousand keys costs ~27 µs on an H200. The one-hot is [keys, pairs] so each prefix sum runs
    # along the contiguous dimension (a scan down 9 columns of 1024 rows is sequential: 150 µs).
    # A comparison, not F.one_hot, which may read the keys' range on the host.
    one_hot_EN = (torch.arange(num_local_experts + 1, device=device)[:, None] == key_N[None, :]).to(torch.int32)
    seen_EN = one_hot_EN.cumsum(dim=1, dtype=torch.int32)
    counts_E = seen_EN[:, -1].long() if key_N.numel() else torch.zeros(num_local_experts + 1, dtype=torch.int64,
                                                                           device=device)
    start_E = counts_E.cumsum(0) - counts_E
    rank_in_key_N = seen_EN.gather(0, key_N[None, :]).squeeze(0).long() - 1
    pair_row_N = start_E[key_N] + rank_in_key_N  # where pair n lands in expert order
    order_R = torch.empty_like(pair_row_N).scatter_(0, pair_row_N, torch.arange(key_N.shape[0], device=device))
    is_real_R = torch.arange(key_N.shape[0], device=device) < start_E[num_local_experts]
    row_R = torch.where(is_real_R, torch.div(order_R, k, rounding_mode="floor"), num_slots)
    pair_weight_SK = torch.where(is_local_SK, weights_SK.float(), 0.0)
    layout = ExpertLayout(row_R=row_R, weight_R=pair_weight_SK.reshape(-1)[order_R],
                          num_rows_per_expert_L=counts_E[:num_local_experts])
    return FixedLayout(layout, pair_row_N.view(num_slots, k), pair_weight_SK, is_local_SK)


def reduce_pairs(expert_y_RH: torch.Tensor, fixed: FixedLayout) -> torch.Tensor:
    """Each slot's weighted sum over its local experts' outputs: ``[S, H]`` in ``expert_y``'s dtype.

    A gather back to slot order, then one batched ``[1, K] x [K, H]`` product per slot: no atomics,
    and the product accumulates in float32 (the weights are rounded to the activation dtype first).
    Non-local pairs gather padding rows, whose outputs are undefined: they are zeroed, not weighted.
    """
    num_slots, k = fixed.pair_row_SK.shape
    y_SKH = expert_y_RH.index_select(0, fixed.pair_row_SK.reshape(-1)).view(num_slots, k, -1)
    y_SKH.masked_fill_(~fixed.is_local_SK[:, :, None], 0)
    weights_S1K = fixed.pair_weight_SK.to(expert_y_RH.dtype)[:, None, :]
    return torch.bmm(weights_S1K, y_SKH).squeeze(1)


# ---- the dispatcher ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Buffers:
    """One set of communication buffers, allocated once and reused by every forward that uses it.

    The receive buffers have one extra, never-written row of zeros (index S): the padding slot that
    padding rows gather from. ``*_dst``: where the fused kernels write the block for rank p (the
    send buffer for NCCL, the receive buffer with no collective, the peer's symmetric receive
    buffer for ``symm_mem``); ``*_barrier``: the symmetric-memory handle whose
    barrier completes the phase (``symm_mem`` only).
    """

    dispatch_send_SB: torch.Tensor
    dispatch_recv_SB: torch.Tensor  # [S + 1, B]
    combine_send_SH: torch.Tensor
    combine_recv_SH: torch.Tensor  # [S + 1, H]
    dispatch_dst: "ll_kernels.Destinations | None"
    combine_dst: "ll_kernels.Destinations | None"
    dispatch_barrier: object = field(default=None, compare=False)
    combine_barrier: object = field(default=None, compare=False)


@dataclass
class RoundCounter:
    """Dispatches launched so far by a dispatcher and its twins; round n uses buffer set n % num_buffers."""

    launched: int = 0


class _SymmBarrier:
    """The "work" of a symmetric-memory phase: its data already went out inside the kernel, so
    waiting is a barrier with every peer (after it, their writes to this rank are visible)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def wait(self) -> None:
        self.handle.barrier(channel=0)


@dataclass(frozen=True)
class LowLatencyHandle(DispatchHandle):
    """Adds the sender's ``slot_TP`` (for summing the P returned rows), the receiver's ``fixed``
    layout, the row format, the buffer set and the round (``generation``) that owns it."""

    slot_TP: torch.Tensor | None = None
    fmt: RowFormat | None = None
    fixed: "FixedLayout | ll_kernels.KernelLayout | None" = None
    buffers: _Buffers | None = None
    generation: int = 0


@dataclass(frozen=True)
class _InFlightDispatch:
    fmt: RowFormat
    slot_TP: torch.Tensor
    buffers: _Buffers
    generation: int
    num_tokens: int
    traffic: Traffic


KERNELS = ("auto", "triton", "torch")
TRANSPORTS = ("auto", "nccl", "symm_mem")


@functools.cache  # asked on every forward; the answer is fixed for the process
def _peers_reachable(ep_size: int) -> bool:
    """Whether an EP group of ``ep_size`` can be one node's GPUs with peer access between them all
    (symmetric memory maps the peers' buffers): the group fits this node (torchrun's
    ``LOCAL_WORLD_SIZE`` when set) and every pair of local GPUs has peer access. The same answer on
    every rank of a node, so ``transport="auto"`` resolves alike everywhere."""
    num_gpus = torch.cuda.device_count()
    if ep_size > num_gpus or env.local_world_size(ep_size) < ep_size:
        return False
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(num_gpus) for b in range(num_gpus) if a != b)


@register_dispatcher
class LowLatencyDispatcher(Dispatcher):
    """Fixed-capacity dispatch and combine, one fixed-size transfer each way.

    ``max_tokens_per_rank`` (C): the most tokens any rank may pass to one dispatch; more raise
    ``ValueError`` before any collective. ``fp8``: send x as e4m3 with a float32 scale per token and
    128 values (H must be a multiple of 128), dequantised on arrival; combine stays in the activation
    dtype. ``num_buffers``: buffer sets used in turn, so that many rounds may be in flight at once
    (2, as DeepEP: one per micro-batch of two-batch overlap); a round whose buffers a later round
    took raises instead of reading them.

    ``kernels``: ``"triton"`` runs the five fused kernels (``ll_kernels`` and ``reduce.gather_sum``;
    CUDA, or CPU under ``TRITON_INTERPRET=1``); ``"torch"`` the reference chain of torch ops (any
    device); ``"auto"`` Triton on CUDA when it imports, torch otherwise. Both produce the same bytes on the wire and
    the same layout; combine sums in float32 either way (the order differs, so bf16 results may
    differ by an ulp between the two, never run to run).

    ``transport``: ``"nccl"`` a fixed-size ``all_to_all_single`` per phase (portable, capturable;
    gloo on CPU); ``"symm_mem"`` PyTorch symmetric memory: the fused kernels write each block
    straight into the peer's receive buffer over NVLink and the phase ends with a symmetric-memory
    barrier (CUDA and ``kernels="triton"`` only; buffers are rendezvoused on the first forward);
    ``"auto"`` (default) ``symm_mem`` where it can run (CUDA, fused kernels, EP > 1 within one node
    whose GPUs reach each other: the faster one on 2x H200, docs/BENCHMARKS.md), ``nccl`` elsewhere.

    Inference only: a forward with autograd enabled raises (wrap it in ``torch.inference_mode()``).

    Sync: no phase reads anything on the host, and every shape is fixed by C, so after one eager
    forward (which allocates the buffers) the whole forward is CUDA-graph capturable. Transfers run
    on the communicator's stream; ``*_wait`` makes the current stream wait for them (CUDA) or blocks
    the host (gloo). Without an initialised process group (one rank) the transfer is a local copy
    (or, with the fused kernels, no copy: they write the receive buffer directly).
    """

    name = "low_latency"
    graph_capturable = True  # a fact of the scheme (fixed shapes, no host read), not a knob

    def __init__(self, num_experts: int, ep: EPGroup, *, max_tokens_per_rank: int = 128, fp8: bool = False,
                 num_buffers: int = 2, kernels: str = "auto", transport: str = "auto"):
        super().__init__(num_experts, ep)
        for option, value in (("max_tokens_per_rank", max_tokens_per_rank), ("num_buffers", num_buffers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} must be an int >= 1, got {value!r}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if (kernels == "triton" or transport == "symm_mem") and ll_kernels is None:
            raise ValueError(f"kernels={kernels!r} / transport={transport!r} need Triton, which does not import "
                             "here; pip install triton, or use kernels='torch', transport='nccl'")
        if transport == "symm_mem" and kernels == "torch":
            raise ValueError("transport='symm_mem' writes into the peers' buffers from the fused Triton kernels; "
                             "use kernels='triton' or 'auto' with it, or transport='nccl' with kernels='torch'")
        self.capacity = max_tokens_per_rank
        self.fp8 = bool(fp8)
        self.num_buffers = num_buffers
        self.kernels = kernels
        self.transport = transport
        self.num_slots = ep.size * max_tokens_per_rank
        # One rank uses the real communicator when there is one (a graph then captures what it would
        # at EP > 1); without a process group, or with a one-rank EP group inside a larger job, it
        # copies locally.
        self._collective = ep.size > 1 or (dist.is_initialized() and dist.get_world_size(ep.group) == 1)
        self._buffers: dict[tuple, list[_Buffers]] = {}
        # Shared with twin() dispatchers (two-batch overlap): they take turns on the same buffer sets.
        self._rounds = RoundCounter()

    # ---- validation (before any collective, no host read of device data) -----------------------------

    def uses_triton(self, device: torch.device) -> bool:
        """Whether a forward on ``device`` runs the fused Triton kernels."""
        if self.kernels == "torch" or ll_kernels is None:
            return False
        return device.type == "cuda" or (self.kernels == "triton" and interpreting_triton())

    def transport_for(self, device: torch.device) -> str:
        """The transport a forward on ``device`` uses (``"auto"`` resolved; the same on every rank)."""
        if self.transport != "auto":
            return self.transport
        usable = device.type == "cuda" and self.uses_triton(device) and self._collective and self.ep.size > 1
        return "symm_mem" if usable and _peers_reachable(self.ep.size) else "nccl"

    def _check_dispatch_input(self, inp: DispatchInput) -> None:
        super()._check_dispatch_input(inp)
        if torch.is_grad_enabled():
            raise RuntimeError(
                "low_latency is inference-only (rows travel as packed bytes through reused buffers, which "
                "carry no autograd graph); run the forward under torch.inference_mode() or torch.no_grad()"
            )
        num_tokens, hidden = inp.x_TH.shape
        if num_tokens > self.capacity:
            raise ValueError(
                f"tokens per rank must be <= max_tokens_per_rank = {self.capacity} of this low_latency "
                f"dispatcher, got T = {num_tokens}; split the batch into chunks of at most {self.capacity} "
                "tokens, or build it with a larger capacity (MoELayer(..., dispatcher_options="
                "{'max_tokens_per_rank': N}))"
            )
        if self.fp8 and hidden % FP8_GROUP:
            raise ValueError(
                f"hidden size must be a multiple of {FP8_GROUP} for fp8 dispatch (one scale per {FP8_GROUP} "
                f"values), got H = {hidden}; use fp8=False for this model"
            )
        device = inp.x_TH.device
        if self.uses_triton(device) and hidden * inp.x_TH.element_size() % 16:
            raise ValueError(
                f"the fused low_latency kernels need rows of a multiple of 16 bytes, got H = {hidden} x "
                f"{inp.x_TH.element_size()} bytes; use kernels='torch' for this model"
            )
        if self.kernels == "triton" and device.type != "cuda" and not interpreting_triton():
            raise ValueError(
                f"kernels='triton' needs CUDA tensors (or TRITON_INTERPRET=1, Triton's CPU interpreter), got x on "
                f"{device}; use kernels='auto' or 'torch' here"
            )
        if self.transport_for(device) == "symm_mem" and (device.type != "cuda" or not self._collective):
            raise ValueError(
                "transport='symm_mem' needs CUDA tensors and an initialised NCCL process group (it writes into "
                f"the peers' GPU buffers), got x on {device}"
                f"{'' if self._collective else ' without a process group'}; use transport='nccl'"
            )

    def _check_topk_ids(self, ids_TK: torch.Tensor) -> None:
        """Ids in ``[-1, E)``, -1 meaning "no expert". Never a host read of device data: on CUDA a
        device-side assert (a bad id aborts at the next synchronising call: loud, never a silent
        drop); on CPU there is no device, so a plain check raises ``ValueError`` here."""
        if not ids_TK.numel():
            return
        if ids_TK.device.type == "cuda" and self.uses_triton(ids_TK.device):
            return  # the pack kernel checks every id it reads; _launch_dispatch asserts on its flags
        in_range = ((ids_TK >= -1) & (ids_TK < self.num_experts)).all()
        if ids_TK.device.type != "cpu":
            torch._assert_async(in_range, f"topk_ids must lie in [-1, {self.num_experts})")
        elif not bool(in_range):
            raise ValueError(
                f"topk_ids must lie in [-1, {self.num_experts}) (-1: no expert), got values in "
                f"[{int(ids_TK.min())}, {int(ids_TK.max())}]; the router and the dispatcher disagree on "
                "the expert count"
            )

    # ---- buffers -------------------------------------------------------------------------------------

    def buffers(self, device: torch.device, dtype: torch.dtype, hidden: int, top_k: int) -> list[_Buffers]:
        """The buffer sets for this device, activation dtype and shape; allocated on first use only
        (with ``symm_mem``, a collective rendezvous: every rank's first forward reaches it together)."""
        key = (device, dtype, hidden, top_k)
        if key not in self._buffers:
            fmt = RowFormat.make(hidden, top_k, dtype, self.fp8)
            with torch.inference_mode(False):
                # Normal tensors even when first used under inference_mode: inference tensors could
                # not be written by a later forward under plain no_grad.
                self._buffers[key] = [self._allocate(device, dtype, fmt) for _ in range(self.num_buffers)]
        return self._buffers[key]

    def _allocate(self, device: torch.device, dtype: torch.dtype, fmt: RowFormat) -> _Buffers:
        s, c, rank, hidden = self.num_slots, self.capacity, self.ep.rank, fmt.hidden
        dispatch_send = torch.zeros(s, fmt.row_bytes, dtype=torch.uint8, device=device)
        combine_send = torch.zeros(s, hidden, dtype=dtype, device=device)
        handles = (None, None)
        if self.transport_for(device) == "symm_mem":
            import torch.distributed._symmetric_memory as symm_mem

            recvs, handles = [], []
            for cols, dt in ((fmt.row_bytes, torch.uint8), (hidden, dtype)):
                recv = symm_mem.empty((s + 1, cols), dtype=dt, device=device).zero_()
                handle = symm_mem.rendezvous(recv, self.ep.group or dist.group.WORLD)
                recvs.append(recv)
                handles.append(handle)
            # This rank's block in each peer's receive buffer.
            peer = [[h.get_buffer(p, (s + 1, cols), dt).data_ptr() for p in range(self.ep.size)]
                    for h, cols, dt in ((handles[0], fmt.row_bytes, torch.uint8), (handles[1], hidden, dtype))]
            dispatch_dst = [ptr + rank * c * fmt.row_bytes for ptr in peer[0]]
            combine_dst = [ptr + rank * c * hidden * dtype.itemsize for ptr in peer[1]]
            dispatch_recv, combine_recv = recvs
            torch.cuda.synchronize(device)
            dist.barrier(group=self.ep.group)  # every peer zeroed its padding rows before anyone writes
        else:
            dispatch_recv = torch.zeros(s + 1, fmt.row_bytes, dtype=torch.uint8, device=device)
            combine_recv = torch.zeros(s + 1, hidden, dtype=dtype, device=device)
            # NCCL: the blocks go to the send buffer; one rank without a collective: straight to recv.
            d_base, c_base = ((dispatch_send, combine_send) if self._collective else (dispatch_recv, combine_recv))
            dispatch_dst = [d_base.data_ptr() + p * c * fmt.row_bytes for p in range(self.ep.size)]
            combine_dst = [c_base.data_ptr() + p * c * hidden * dtype.itemsize for p in range(self.ep.size)]
        if ll_kernels is None:
            return _Buffers(dispatch_send, dispatch_recv, combine_send, combine_recv, None, None, *handles)
        return _Buffers(dispatch_send, dispatch_recv, combine_send, combine_recv,
                        ll_kernels.Destinations.make(dispatch_recv, dispatch_dst),
                        ll_kernels.Destinations.make(combine_recv, combine_dst), *handles)

    def _check_round(self, generation: int) -> None:
        if self._rounds.launched - generation > self.num_buffers:
            raise RuntimeError(
                f"this dispatch's buffers were taken by a later one: {self._rounds.launched - generation - 1} "
                f"dispatches started after it, but a low_latency dispatcher keeps num_buffers = "
                f"{self.num_buffers} rounds in flight; combine each round before starting more, or raise "
                "num_buffers"
            )

    def _exchange(self, recv: torch.Tensor, send: torch.Tensor, fused: bool, barrier) -> list:
        """Start the fixed-size transfer of ``send`` into ``recv`` (works to wait on). With the fused
        kernels the blocks are already in place for ``symm_mem`` (a barrier remains) and without a
        collective (nothing remains); otherwise an all-to-all, or a local copy."""
        if fused and barrier is not None:  # symm_mem: the kernel wrote into the peers' buffers
            return [_SymmBarrier(barrier)]
        if not self._collective:
            if not fused:
                recv.copy_(send)
            return []
        return [dist.all_to_all_single(recv, send, group=self.ep.group, async_op=True)]

    # ---- the four phases -----------------------------------------------------------------------------

    def _launch_dispatch(self, inp: DispatchInput) -> Pending:
        x_TH, ids_TK = inp.x_TH, inp.topk_ids_TK
        num_tokens, hidden = x_TH.shape
        fmt = RowFormat.make(hidden, ids_TK.shape[1], x_TH.dtype, self.fp8)
        generation = self._rounds.launched
        self._rounds.launched += 1
        bufs = self.buffers(x_TH.device, x_TH.dtype, hidden, ids_TK.shape[1])[generation % self.num_buffers]
        fused = self.uses_triton(x_TH.device)
        if fused:
            slot_TP = torch.empty(num_tokens, self.ep.size, dtype=torch.int64, device=x_TH.device)
            ids_ok_C = ll_kernels.pack_rows(x_TH.contiguous(), ids_TK.contiguous(),
                                            inp.topk_weights_TK.float().contiguous(), bufs.dispatch_dst, slot_TP,
                                            fmt, self.num_local_experts, self.capacity)
            if x_TH.device.type == "cuda":
                torch._assert_async(ids_ok_C.amin(), f"topk_ids must lie in [-1, {self.num_experts})")
        else:
            plan = plan_send(ids_TK, self.num_local_experts, self.ep.size, self.capacity)
            rows_TB = fmt.pack(x_TH, ids_TK, inp.topk_weights_TK)
            torch.index_select(rows_TB, 0, plan.token_S, out=bufs.dispatch_send_SB)
            slot_TP = plan.slot_TP
        works = self._exchange(bufs.dispatch_recv_SB[:self.num_slots], bufs.dispatch_send_SB, fused,
                               bufs.dispatch_barrier)
        block_bytes = (self.ep.size - 1) * self.capacity * fmt.row_bytes
        traffic = Traffic(dispatch_bytes_sent=block_bytes, dispatch_bytes_recv=block_bytes)
        return Pending(works=works, state=_InFlightDispatch(fmt, slot_TP, bufs, generation, num_tokens, traffic))

    def _wait_dispatch(self, pending: Pending) -> DispatchOutput:
        pending.wait()
        s: _InFlightDispatch = pending.state
        self._check_round(s.generation)
        recv_SB = s.buffers.dispatch_recv_SB
        if self.uses_triton(recv_SB.device):
            fixed = ll_kernels.expert_layout(recv_SB[:self.num_slots], s.fmt, self.ep.rank, self.num_local_experts)
            expert_x_RH = ll_kernels.gather_rows(recv_SB, fixed, s.fmt)
        else:
            local_ids_SK = self._local_ids(s.fmt.ids(recv_SB[:self.num_slots]).long(), self.ep.rank)
            fixed = group_slots_by_expert(local_ids_SK, s.fmt.weights(recv_SB[:self.num_slots]),
                                          self.num_local_experts)
            # x of all S + 1 rows (the last is the zero padding slot), then one gather into expert order.
            expert_x_RH = s.fmt.x(recv_SB)[fixed.layout.row_R]
        handle = LowLatencyHandle(
            num_tokens=s.num_tokens, hidden_size=s.fmt.hidden, dtype=s.fmt.dtype, layout=fixed.layout,
            traffic=s.traffic, slot_TP=s.slot_TP, fmt=s.fmt, fixed=fixed, buffers=s.buffers,
            generation=s.generation,
        )
        return self._output(expert_x_RH, handle)

    def _launch_combine(self, inp: CombineInput) -> Pending:
        handle: LowLatencyHandle = inp.handle  # type: ignore[assignment]
        self._check_round(handle.generation)
        bufs = handle.buffers
        fused = isinstance(handle.fixed, ll_kernels.KernelLayout) if ll_kernels is not None else False
        if fused:
            ll_kernels.reduce_pairs(inp.expert_y_RH.contiguous(), handle.fixed, bufs.dispatch_recv_SB, handle.fmt,
                                    bufs.combine_dst, self.capacity)
        else:
            bufs.combine_send_SH.copy_(reduce_pairs(inp.expert_y_RH, handle.fixed))
        works = self._exchange(bufs.combine_recv_SH[:self.num_slots], bufs.combine_send_SH, fused,
                               bufs.combine_barrier)
        block_bytes = (self.ep.size - 1) * self.capacity * handle.hidden_size * bufs.combine_send_SH.element_size()
        traffic = Traffic(combine_bytes_sent=block_bytes, combine_bytes_recv=block_bytes)
        return Pending(works=works, state=(bufs.combine_recv_SH, fused), traffic=traffic)

    def _wait_combine(self, pending: Pending) -> torch.Tensor:
        pending.wait()
        handle: LowLatencyHandle = pending.handle  # type: ignore[assignment]
        self._check_round(handle.generation)
        recv_SH, fused = pending.state
        # Each token's P returned rows (slot S where it sent nothing), summed in float32 in a fixed order.
        return gather_sum(recv_SH[:self.num_slots], handle.slot_TP, out_dtype=handle.dtype,
                          kernels="triton" if fused else "torch")


def mask_padding_tokens(num_tokens: torch.Tensor) -> HookFn:
    """A ``pre_dispatch`` hook for a capacity-sized input whose real token count lives on the device.

    ``num_tokens``: int tensor with one element, on the input's device; rows at index >= it get
    topk_ids -1, so ``low_latency`` sends them nowhere and their routed output is zero (the caller
    ignores those rows). Changing the tensor's value between CUDA-graph replays changes the real
    count without re-capturing and without a host read::

        layer.dispatcher.hooks.register("pre_dispatch", mask_padding_tokens(n_1))
    """

    def hook(dispatcher: Dispatcher, inp: DispatchInput) -> DispatchInput:
        ids_TK = inp.topk_ids_TK
        is_padding_T = torch.arange(ids_TK.shape[0], device=ids_TK.device) >= num_tokens.reshape(())
        return DispatchInput(inp.x_TH, ids_TK.masked_fill(is_padding_T[:, None], -1), inp.topk_weights_TK)

    return hook
