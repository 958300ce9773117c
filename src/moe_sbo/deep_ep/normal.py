"""DeepEP's normal mode (``Buffer.dispatch`` / ``Buffer.combine``) over moe-sbo's ``alltoall`` and
``node_aware`` dispatchers, through their public contract only.

Legend: see ``moe_sbo/__init__.py``; here M is DeepEP's received rows (one per (token, this rank),
in source-rank then token order), Ms the rows the scheme moved (M plus "ghost" rows, below), W the
int32 words of one packed row and Y the route ids a row carries (K, or P without top-k).

::

    dispatch  pack each token's row: x (bf16, or fp8 and its scales) as bytes, (source rank, token),
              its route ids and top-k weights          -> one int32 [T, W] payload
              dispatcher.dispatch(payload, ids, weights) -> rows grouped by local expert
              each moved row once (its first local pair), sorted by (source rank, token) -> DeepEP's rows
    combine   DeepEP's rows back in the scheme's order, and a handle whose layout says "expert row m is
              moved row m, weight 1": the scheme then returns every row unweighted and the token's rank
              sums them (float32), as DeepEP's combine does

The hard part is that DeepEP's normal mode moves rows, while a moe-sbo dispatcher moves (token,
expert) pairs and combines them weighted. The payload carries everything DeepEP returns, so nothing
depends on a scheme's internals: the order of the moved rows (``node_aware`` delivers them by
forwarding rank, not by source rank) is undone by the carried source ids. Ids of -1 are allowed: the
dispatcher is given, in their place, another of the token's ids (weight 0), so the token reaches the
same ranks; a token with no expert at all goes to this rank's first expert and is dropped on arrival
(a ghost row, which combine returns as zero).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..dispatch import Dispatcher, DispatchHandle, EPGroup
from ..dispatch.layout import ExpertLayout
from .layout import align_counts, check_topk_idx

# Positions of DeepEP's handle tuples whose content this package keeps: intranode (6 fields) and
# internode (10 fields); the other positions hold DeepEP's channel prefix matrices and send heads,
# which exist only inside its kernels.
INTRANODE_FIELDS = {0: "rank_prefix_matrix", 3: "recv_src_idx", 4: "is_token_in_rank"}
INTERNODE_FIELDS = {0: "is_token_in_rank", 6: "recv_gbl_rank_prefix_sum"}


@dataclass(frozen=True)
class NormalHandle:
    """What a normal-mode dispatch returns as ``handle``: for a cached re-dispatch and for combine.

    DeepEP-visible fields: ``is_token_in_rank`` bool [T, P]; ``rank_prefix_matrix`` int32 [P, P]
    (entry [i, j]: tokens ranks 0..i send to rank j); ``recv_src_idx`` int32 [M] (each received row's
    token index on its source rank); ``recv_gbl_rank_prefix_sum`` int32 [P] (rows received from ranks
    0..i, column ``rank`` of the matrix). Indexing (``handle[0]``, ``handle[-4]``) reads them at
    DeepEP's tuple positions (intranode or internode, by ``num_nodes``); a position DeepEP fills
    with a kernel-internal matrix raises ``ValueError``.

    Internal: the ``dispatcher`` and its ``dispatch_handle``; ``scheme_rows_M`` int64 [M], where
    each received row lies among the ``num_scheme_rows`` rows the scheme moved.
    """

    num_nodes: int
    is_token_in_rank: torch.Tensor
    rank_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    recv_gbl_rank_prefix_sum: torch.Tensor
    dispatcher: Dispatcher
    dispatch_handle: DispatchHandle
    scheme_rows_M: torch.Tensor
    num_scheme_rows: int

    @property
    def num_recv_tokens(self) -> int:
        return self.scheme_rows_M.shape[0]

    def __len__(self) -> int:
        return 10 if self.num_nodes > 1 else 6

    def __getitem__(self, index: int) -> torch.Tensor:
        fields = INTERNODE_FIELDS if self.num_nodes > 1 else INTRANODE_FIELDS
        position = index + len(self) if isinstance(index, int) and index < 0 else index
        if position not in fields:
            raise ValueError(
                f"handle[{index}] is a DeepEP kernel-internal field that moe_sbo.deep_ep does not keep; "
                f"the handle holds {', '.join(f'[{i}] {n}' for i, n in fields.items())} (also as attributes)"
            )
        return getattr(self, fields[position])


@dataclass(frozen=True)
class RowPacking:
    """Where each part lies in a packed row of int32 words: x's bytes (``x_words``), the scales'
    (``scale_words``, 0 without), the source rank and token (2 words), ``num_route_ids`` ids and, with
    ``has_weights``, as many float32 weights."""

    hidden: int
    x_dtype: torch.dtype
    num_scales: int
    num_route_ids: int
    has_weights: bool

    @property
    def x_words(self) -> int:
        return -(-self.hidden * self.x_dtype.itemsize // 4)

    @property
    def scale_words(self) -> int:
        return self.num_scales

    @property
    def words(self) -> int:
        return self.x_words + self.scale_words + 2 + self.num_route_ids * (2 if self.has_weights else 1)

    def pack(
        self,
        x_TH: torch.Tensor,
        scales_TQ: torch.Tensor | None,
        src_T2: torch.Tensor,
        route_TY: torch.Tensor,
        weights_TY: torch.Tensor | None,
    ) -> torch.Tensor:
        parts = [_as_words(x_TH)]
        if scales_TQ is not None:
            parts.append(scales_TQ.float().contiguous().view(torch.int32))
        parts += [src_T2.int(), route_TY.int()]
        if weights_TY is not None:
            parts.append(weights_TY.float().contiguous().view(torch.int32))
        return torch.cat(parts, dim=1)

    def unpack(self, rows_MW: torch.Tensor) -> dict[str, Any]:
        at = 0

        def take(words: int) -> torch.Tensor:
            nonlocal at
            part = rows_MW[:, at : at + words]
            at += words
            return part.contiguous()

        x_bytes = take(self.x_words).view(torch.uint8)[:, : self.hidden * self.x_dtype.itemsize]
        out: dict[str, Any] = {"x": x_bytes.contiguous().view(self.x_dtype)}
        out["scales"] = take(self.scale_words).view(torch.float32) if self.num_scales else None
        out["src"] = take(2)
        out["route"] = take(self.num_route_ids)
        out["weights"] = take(self.num_route_ids).view(torch.float32) if self.has_weights else None
        return out


def _as_words(t_TX: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor's rows as int32 words (its bytes, zero-padded to a multiple of 4)."""
    bytes_TX = t_TX.contiguous().view(torch.uint8)
    pad = -bytes_TX.shape[1] % 4
    if pad:
        bytes_TX = torch.nn.functional.pad(bytes_TX, (0, pad))
    return bytes_TX.view(torch.int32)


def routable_ids(ids_TY: torch.Tensor, fallback: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids a dispatcher accepts (no -1) that reach the same ranks: each -1 becomes the row's largest id,
    a row of only -1 gets ``fallback`` everywhere -> (ids int64 [T, Y], bool [T, Y] of the real ones)."""
    ids_TY = ids_TY.long()
    is_real_TY = ids_TY >= 0
    if ids_TY.shape[1] == 0:
        return ids_TY, is_real_TY
    largest_T = ids_TY.amax(dim=1)
    fill_T = torch.where(largest_T >= 0, largest_T, fallback)
    return torch.where(is_real_TY, ids_TY, fill_T[:, None]), is_real_TY


def split_x(x: Any, name: str = "x") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` or ``(x, scales)`` -> (x [T, H], scales float32 [T, Q] or None), shapes checked."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"{name} must be a tensor or a (fp8 tensor, scales) pair, got a tuple of {len(x)}")
        x_TH, scales_TQ = x
    else:
        x_TH, scales_TQ = x, None
    if not isinstance(x_TH, torch.Tensor) or x_TH.dim() != 2:
        raise ValueError(f"{name} must be [num_tokens, hidden], got {getattr(x_TH, 'shape', type(x_TH).__name__)}")
    if scales_TQ is not None:
        if scales_TQ.dim() != 2 or scales_TQ.shape[0] != x_TH.shape[0]:
            raise ValueError(
                f"{name}'s scales must be [num_tokens, hidden // 128] = [{x_TH.shape[0]}, ...], "
                f"got {tuple(scales_TQ.shape)}"
            )
        if scales_TQ.dtype != torch.float32:
            raise TypeError(f"{name}'s scales must be float32, got {scales_TQ.dtype}")
    return x_TH, scales_TQ


def exchange_counts(
    ep: EPGroup, num_tokens_per_rank_P: torch.Tensor, per_expert_E: torch.Tensor | None
) -> torch.Tensor:
    """Every rank's row counts to each rank and (if given) pairs per expert, gathered: int64
    [P, P (+ E)], row i from rank i. Sync: one all-gather on the group."""
    mine = num_tokens_per_rank_P.long()
    if per_expert_E is not None:
        mine = torch.cat([mine, per_expert_E.long().to(mine.device)])
    if ep.size == 1 or not dist.is_initialized():
        return mine[None, :]
    # On the group's own device: the GPU for NCCL, the host for gloo (also when it moves CUDA tensors).
    on_gpu = dist.get_backend(ep.group) == "nccl"
    mine = mine.to(torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
    gathered = [torch.empty_like(mine) for _ in range(ep.size)]
    dist.all_gather(gathered, mine.contiguous(), group=ep.group)
    return torch.stack(gathered)


def dispatch(
    ep: EPGroup,
    dispatcher_for: Any,
    num_nodes: int,
    x: Any,
    handle: NormalHandle | None,
    is_token_in_rank: torch.Tensor | None,
    num_tokens_per_expert: torch.Tensor | None,
    topk_idx: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    expert_alignment: int,
    num_worst_tokens: int,
) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, NormalHandle | None]:
    """``Buffer.dispatch`` without its event: (recv_x, recv_topk_idx, recv_topk_weights, the list of
    rows per local expert, handle); a cached dispatch (``handle`` given) returns only recv_x.
    ``dispatcher_for(num_experts)`` gives the scheme's dispatcher for that expert count.

    Sync: the host blocks on the counts' all-gather, the scheme's count exchange and one read of
    the received row count, as DeepEP's normal mode does; not CUDA-graph safe."""
    x_TH, scales_TQ = split_x(x)
    num_tokens, hidden = x_TH.shape
    if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment < 1:
        raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
    if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
        raise ValueError(f"num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")
    if handle is not None:
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("a cached dispatch (handle given) moves x only; pass topk_idx=None and topk_weights=None")
        if not isinstance(handle, NormalHandle):
            raise TypeError(f"handle must be the one a normal-mode dispatch returned, got {type(handle).__name__}")
        is_token_in_rank, num_tokens_per_expert = handle.is_token_in_rank, None
    if is_token_in_rank is None or tuple(is_token_in_rank.shape) != (num_tokens, ep.size):
        got = None if is_token_in_rank is None else tuple(is_token_in_rank.shape)
        raise ValueError(
            f"is_token_in_rank must be bool [num_tokens, num_ranks] = [{num_tokens}, {ep.size}] (from "
            f"get_dispatch_layout), got {got}"
        )
    if (topk_idx is None) != (topk_weights is None):
        raise ValueError("topk_idx and topk_weights go together: pass both or neither")
    if topk_idx is not None and topk_weights is not None:
        check_topk_idx(topk_idx)
        if num_tokens_per_expert is None:
            raise ValueError("num_tokens_per_expert (from get_dispatch_layout) must be given with topk_idx")
        if topk_idx.shape[0] != num_tokens or tuple(topk_weights.shape) != tuple(topk_idx.shape):
            raise ValueError(
                f"topk_idx and topk_weights must be [num_tokens, num_topk] with num_tokens = {num_tokens}, got "
                f"{tuple(topk_idx.shape)} and {tuple(topk_weights.shape)}"
            )
    if num_tokens_per_expert is not None and num_tokens_per_expert.numel() % ep.size:
        raise ValueError(
            f"num_tokens_per_expert must have num_experts entries, a multiple of the EP size {ep.size}, got "
            f"{num_tokens_per_expert.numel()}"
        )

    # Route ids: the top-k experts, or without top-k one pseudo expert per destination rank.
    if topk_idx is not None:
        assert num_tokens_per_expert is not None and topk_weights is not None  # checked above
        num_experts, route_TY, weights_TY = num_tokens_per_expert.numel(), topk_idx, topk_weights.float()
    else:
        num_experts, weights_TY = ep.size, None
        ranks_P = torch.arange(ep.size, device=x_TH.device)
        route_TY = torch.where(is_token_in_rank.to(x_TH.device), ranks_P, -1)
    dispatcher = dispatcher_for(num_experts)
    num_local = num_experts // ep.size
    ids_TY, is_real_TY = routable_ids(route_TY, fallback=ep.rank * num_local)
    dispatch_weights_TY = torch.where(is_real_TY, weights_TY, 0.0) if weights_TY is not None else is_real_TY.float()

    counts = exchange_counts(ep, is_token_in_rank.sum(dim=0), num_tokens_per_expert if handle is None else None)
    packing = RowPacking(
        hidden, x_TH.dtype, 0 if scales_TQ is None else scales_TQ.shape[1], route_TY.shape[1], weights_TY is not None
    )
    src_T2 = torch.stack(
        [torch.full((num_tokens,), ep.rank, device=x_TH.device), torch.arange(num_tokens, device=x_TH.device)], 1
    )
    payload_TW = packing.pack(x_TH, scales_TQ, src_T2, route_TY, weights_TY)
    out = dispatcher.dispatch(payload_TW, ids_TY, dispatch_weights_TY)

    # Each moved row once: its first pair among this rank's expert rows (every moved row has one).
    pair_MK = out.handle.layout.pair_MK
    assert pair_MK is not None, f"{dispatcher.name}'s layout maps moved rows to pairs (pair_MK)"
    num_scheme_rows = pair_MK.shape[0]
    rows_MW = out.rows_RH()[pair_MK.min(dim=1).values] if num_scheme_rows else payload_TW[:0]
    parts = packing.unpack(rows_MW)
    local_MY = parts["route"].long() - ep.rank * num_local
    is_local_MY = (local_MY >= 0) & (local_MY < num_local)
    is_kept_M = is_local_MY.any(dim=1)  # ghost rows (tokens with no expert at all) are not DeepEP's rows
    src_rank_M, src_token_M = parts["src"].long().unbind(1)
    key_M = torch.where(is_kept_M, src_rank_M * 2**32 + src_token_M, 2**62)
    num_recv = int(is_kept_M.sum())  # one host read: DeepEP's normal mode returns a sized tensor
    scheme_rows_M = torch.sort(key_M, stable=True).indices[:num_recv]

    recv_x = parts["x"][scheme_rows_M]
    recv_scales = parts["scales"][scheme_rows_M] if parts["scales"] is not None else None
    matrix_PP = counts[:, : ep.size].to(torch.int32).cumsum(dim=0, dtype=torch.int32)
    recv_prefix_P = matrix_PP[:, ep.rank].contiguous()
    new_handle = NormalHandle(
        num_nodes=num_nodes,
        is_token_in_rank=is_token_in_rank,
        rank_prefix_matrix=matrix_PP.to(x_TH.device),
        recv_src_idx=src_token_M[scheme_rows_M].int(),
        recv_gbl_rank_prefix_sum=recv_prefix_P.to(x_TH.device),
        dispatcher=dispatcher,
        dispatch_handle=out.handle,
        scheme_rows_M=scheme_rows_M,
        num_scheme_rows=num_scheme_rows,
    )
    if handle is not None:
        return _with_scales(_pad(recv_x, num_worst_tokens, 0), recv_scales, num_worst_tokens), None, None, None, None

    recv_topk_idx = recv_topk_weights = None
    if topk_idx is not None:
        recv_topk_idx = torch.where(is_local_MY, local_MY, -1)[scheme_rows_M].to(topk_idx.dtype)
        recv_topk_weights = torch.where(is_local_MY, parts["weights"], 0.0)[scheme_rows_M]
    if num_worst_tokens:
        if num_recv > num_worst_tokens:
            raise ValueError(
                f"num_worst_tokens must be >= the rows this rank receives, got {num_worst_tokens} < {num_recv}; "
                "use num_tokens * num_ranks, the worst case"
            )
        per_expert_list: list[int] = []
        recv_x = _pad(recv_x, num_worst_tokens, 0)
        recv_topk_idx = _pad(recv_topk_idx, num_worst_tokens, -1)
        recv_topk_weights = _pad(recv_topk_weights, num_worst_tokens, 0)
    else:
        # The senders' per-expert counts, summed for this rank's experts (DeepEP's list, with or without top-k).
        experts_here = (counts.shape[1] - ep.size) // ep.size
        first = ep.size + ep.rank * experts_here
        gathered = counts[:, first : first + experts_here].sum(dim=0) if experts_here else None
        per_expert_list = align_counts(gathered.tolist(), expert_alignment) if gathered is not None else []
    recv = _with_scales(recv_x, recv_scales, num_worst_tokens)
    return recv, recv_topk_idx, recv_topk_weights, per_expert_list, new_handle


def _pad(t: torch.Tensor | None, rows: int, value: float) -> Any:
    if t is None or not rows or t.shape[0] >= rows:
        return t
    pad = t.new_full((rows - t.shape[0], *t.shape[1:]), value)
    return torch.cat([t, pad])


def _with_scales(recv_x: torch.Tensor, recv_scales: torch.Tensor | None, num_worst_tokens: int) -> Any:
    return recv_x if recv_scales is None else (recv_x, _pad(recv_scales, num_worst_tokens, 0))


def combine(
    x_MH: torch.Tensor,
    handle: NormalHandle,
    topk_weights_MK: torch.Tensor | None,
    bias: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``Buffer.combine`` without its event: each token's rows summed over the ranks it went to (no
    weights), plus ``bias``; with ``topk_weights``, their sums too.

    Sync: the scheme's combine (its transfer; the host blocks on CPU); not CUDA-graph safe."""
    if not isinstance(handle, NormalHandle):
        raise TypeError(f"handle must be the one a normal-mode dispatch returned, got {type(handle).__name__}")
    num_recv = handle.num_recv_tokens
    if x_MH.dim() != 2 or x_MH.shape[0] < num_recv:
        raise ValueError(
            f"x must be [num_recv_tokens, hidden] with num_recv_tokens = {num_recv} (the rows dispatch returned), "
            f"got {tuple(x_MH.shape)}"
        )
    if not x_MH.is_floating_point() or x_MH.element_size() < 2:
        raise TypeError(f"x must be bf16, fp16 or fp32 (DeepEP's combine takes bf16 rows), got {x_MH.dtype}")
    hidden = x_MH.shape[1]
    if topk_weights_MK is not None and (topk_weights_MK.dim() != 2 or topk_weights_MK.shape[0] < num_recv):
        raise ValueError(f"topk_weights must be [{num_recv}, num_topk], got {tuple(topk_weights_MK.shape)}")
    biases = [] if bias is None else list(bias) if isinstance(bias, tuple) else [bias]
    if len(biases) > 2:
        raise ValueError(f"bias must be a tensor or a pair of tensors, got {len(biases)}")
    num_tokens = handle.dispatch_handle.num_tokens
    for b in biases:
        if tuple(b.shape) != (num_tokens, hidden):
            raise ValueError(f"bias must be [num_tokens, hidden] = [{num_tokens}, {hidden}], got {tuple(b.shape)}")

    # Float32 rows when weights travel too or a bias follows: one rounding, after the sum.
    wide = topk_weights_MK is not None or biases
    rows_MX = x_MH[:num_recv]
    if wide:
        rows_MX = rows_MX.float()
        if topk_weights_MK is not None:
            rows_MX = torch.cat([rows_MX, topk_weights_MK[:num_recv].float()], dim=1)
    scheme_MX = rows_MX.new_zeros(handle.num_scheme_rows, rows_MX.shape[1])
    scheme_MX[handle.scheme_rows_M] = rows_MX
    combine_handle = dataclasses.replace(
        handle.dispatch_handle,
        layout=identity_layout(handle.num_scheme_rows, handle.dispatcher.num_local_experts, x_MH.device),
        hidden_size=rows_MX.shape[1],
        dtype=rows_MX.dtype,
    )
    y_TX = handle.dispatcher.combine(scheme_MX, combine_handle)
    combined_TH = y_TX[:, :hidden]
    for b in biases:
        combined_TH = combined_TH + b.float()
    combined_weights = y_TX[:, hidden:] if topk_weights_MK is not None else None
    return combined_TH.to(x_MH.dtype), combined_weights


def identity_layout(num_rows: int, num_local_experts: int, device: torch.device) -> ExpertLayout:
    """The layout of "expert row m is moved row m, weight 1" (every row held by local expert 0): with it
    a scheme's combine returns each row unweighted and the token's rank sums them."""
    rows = torch.arange(num_rows, device=device)
    counts_L = torch.zeros(num_local_experts, dtype=torch.int64, device=device)
    counts_L[0] = num_rows
    return ExpertLayout(
        row_R=rows, weight_R=torch.ones(num_rows, device=device), num_rows_per_expert_L=counts_L, pair_MK=rows[:, None]
    )
