"""``allgather``: the scheme before DeepEP. Every rank gathers every token, runs its own experts on
the tokens that chose them, and a reduce-scatter sums the partial outputs back to the tokens' owners
(the seed's all-reduce, minus the rows a rank would discard).

The hard part is variable token counts: collectives need equal chunks, so each rank first learns
every rank's T (one small blocking all-gather), pads to the largest, and the padded rows carry
expert id ``-1`` so no expert computes them. Bytes are counted as the ring algorithm moves them:
(P - 1) chunks each way for both all-gather and reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .base import REJECTED, Dispatcher, register_dispatcher
from .layout import combine_rows, count_per_key, group_rows_by_expert, pack_topk, unpack_topk
from .records import CombineInput, DispatchHandle, DispatchInput, DispatchOutput, Pending, Traffic

# torch 2.13 renamed the tensor-in/tensor-out collectives; 2.11 (the GPU image) has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, kw_only=True)
class AllGatherHandle(DispatchHandle):
    """``tokens_per_rank``: every rank's T (host ints); ``padded_tokens``: the chunk size, max T."""

    tokens_per_rank: tuple[int, ...]
    padded_tokens: int


@dataclass(frozen=True)
class _InFlightDispatch:
    """What ``_wait_dispatch`` needs: the gathered buffers (P * padded rows) and the host counts."""

    all_x_MH: torch.Tensor
    all_meta_M2K: torch.Tensor
    tokens_per_rank: tuple[int, ...]
    padded_tokens: int
    num_pairs: int
    traffic: Traffic


@register_dispatcher
class AllGatherDispatcher(Dispatcher):
    """Gather all tokens everywhere; reduce-scatter the partial sums back."""

    name = "allgather"
    checks_ids_in_count_exchange = True

    def _announce_rejected_input(self) -> None:
        if self.ep.size > 1:  # the token/pair count all-gather of _launch_dispatch, every count REJECTED
            mine = torch.full((1, 1 + self.ep.size), REJECTED, dtype=torch.int64, device=self._counts_device())
            _all_gather_single(mine.new_empty(self.ep.size, 1 + self.ep.size), mine, group=self.ep.group)

    def _launch_dispatch(self, inp: DispatchInput) -> Pending:
        x_TH, ep = inp.x_TH, self.ep
        num_tokens, hidden = x_TH.shape
        # Each rank shares its T and how many of its (token, expert) pairs each rank owns, so every
        # rank learns the chunk size and its own pair count R without reading the payload.
        # The id check rides on this exchange: a rank with a bad id sends REJECTED, no extra host read.
        ids_ok, owner_TK = self._ids_in_range(inp.topk_ids_TK)
        my_counts = torch.cat(
            [
                torch.full((1,), num_tokens, device=x_TH.device, dtype=torch.int64),
                count_per_key(owner_TK.reshape(-1), ep.size),
            ]
        )
        my_counts = torch.where(ids_ok, my_counts, REJECTED)
        counts_PY = my_counts.new_empty(ep.size, 1 + ep.size)  # Y = 1 + P: each rank's T, then its pairs per rank
        _all_gather_single(counts_PY, my_counts[None], group=ep.group)
        counts = counts_PY.tolist()
        self._raise_if_rejected([r for r, row in enumerate(counts) if row[0] == REJECTED], inp.topk_ids_TK)
        tokens_per_rank = tuple(row[0] for row in counts)
        num_pairs = sum(row[1 + ep.rank] for row in counts)
        padded = max(tokens_per_rank)

        # Padding rows: zeros with expert id -1, so they are gathered but never computed.
        pad = padded - num_tokens
        x_pad = torch.nn.functional.pad(x_TH, (0, 0, 0, pad))
        meta = pack_topk(
            torch.nn.functional.pad(inp.topk_ids_TK, (0, 0, 0, pad), value=-1),
            torch.nn.functional.pad(inp.topk_weights_TK.float(), (0, 0, 0, pad)),
        )
        all_x = x_TH.new_empty(ep.size * padded, hidden)
        all_meta = meta.new_empty(ep.size * padded, meta.shape[1])
        works = [
            _all_gather_single(all_x, x_pad.contiguous(), group=ep.group, async_op=True),
            _all_gather_single(all_meta, meta, group=ep.group, async_op=True),
        ]
        chunk_bytes = padded * (hidden * x_TH.element_size() + meta.shape[1] * 4)
        traffic = Traffic(
            dispatch_bytes_sent=(ep.size - 1) * chunk_bytes,
            dispatch_bytes_recv=(ep.size - 1) * chunk_bytes,
            dispatch_inter_node_sent=(ep.size - ep.node_size) * chunk_bytes,  # counted as if sent to each rank
        )
        return Pending(
            works=works, state=_InFlightDispatch(all_x, all_meta, tokens_per_rank, padded, num_pairs, traffic)
        )

    def _wait_dispatch(self, pending: Pending) -> DispatchOutput:
        pending.wait()
        s: _InFlightDispatch = pending.state
        all_ids, all_weights = unpack_topk(s.all_meta_M2K)
        layout = group_rows_by_expert(
            self._local_ids(all_ids, self.ep.rank), all_weights, self.num_local_experts, s.num_pairs
        )
        handle = AllGatherHandle(
            num_tokens=s.tokens_per_rank[self.ep.rank],
            hidden_size=s.all_x_MH.shape[1],
            dtype=s.all_x_MH.dtype,
            layout=layout,
            traffic=s.traffic,
            tokens_per_rank=s.tokens_per_rank,
            padded_tokens=s.padded_tokens,
        )
        return self._output(s.all_x_MH[layout.row_R], handle)

    def _launch_combine(self, inp: CombineInput) -> Pending:
        handle: AllGatherHandle = inp.handle  # type: ignore[assignment]
        ep = self.ep
        # Partial sums for every gathered row; sent in the activation dtype, as on the wire in practice.
        partial_MH = combine_rows(inp.expert_y_RH, handle.layout, handle.dtype)
        out_TH = partial_MH.new_empty(handle.padded_tokens, handle.hidden_size)
        work = _reduce_scatter_single(out_TH, partial_MH, group=ep.group, async_op=True)
        chunk_bytes = handle.padded_tokens * handle.hidden_size * partial_MH.element_size()
        traffic = Traffic(
            combine_bytes_sent=(ep.size - 1) * chunk_bytes,
            combine_bytes_recv=(ep.size - 1) * chunk_bytes,
            combine_inter_node_sent=(ep.size - ep.node_size) * chunk_bytes,
        )
        return Pending(works=[work], state=out_TH, traffic=traffic)

    def _wait_combine(self, pending: Pending) -> torch.Tensor:
        pending.wait()
        return pending.state[: pending.dispatch_handle.num_tokens]
