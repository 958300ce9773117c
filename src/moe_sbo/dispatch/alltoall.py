"""``alltoall``: DeepEP "normal" style. Each token goes once to each rank that owns at least one
of its experts (not once per expert), the receiver expands it to its local experts, and combine
returns one pre-reduced row per (token, rank).

The hard part is that every size is data-dependent: the sender sorts its rows by destination
rank, the ranks exchange row counts (a small blocking all-to-all: the host needs them to size the
receive buffers), then the payload moves in one ``all_to_all_single`` with uneven splits, plus one
for the packed top-k ids/weights. Combine runs the same transfers with the splits swapped.
Bytes exclude each rank's rows to itself (a local copy inside the collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .base import REJECTED, Dispatcher, EPGroup, register_dispatcher
from .layout import combine_rows, count_per_key, group_rows_by_expert, nonzero_static, pack_topk, unpack_topk
from .records import CombineInput, DispatchHandle, DispatchInput, DispatchOutput, Pending, Traffic
from .reduce import gather_sum


@dataclass(frozen=True, kw_only=True)
class AllToAllHandle(DispatchHandle):
    """``slot_TP`` int64 ``[T, P]``: which sent row carried token t to rank p (rows are sorted by
    destination rank), M where it went nowhere; ``send_counts`` / ``recv_counts``: rows to / from
    each rank (host ints)."""

    slot_TP: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]


@dataclass(frozen=True)
class _InFlightDispatch:
    """What ``_wait_dispatch`` needs: the receive buffers and the host-side counts."""

    recv_x_MH: torch.Tensor
    recv_meta_M2K: torch.Tensor
    slot_TP: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    num_pairs: int
    num_tokens: int
    traffic: Traffic


def _remote(counts: tuple[int, ...], rank: int) -> int:
    return sum(counts) - counts[rank]


def _other_nodes(counts: tuple[int, ...], ep: EPGroup) -> int:
    """Of ``counts`` (one per rank), those of ranks on other nodes than this rank's."""
    g = ep.node_size
    node = ep.rank // g
    return sum(counts) - sum(counts[node * g : (node + 1) * g])


@register_dispatcher
class AllToAllDispatcher(Dispatcher):
    """Rank-deduplicated token rows over ``all_to_all_single`` with variable splits."""

    name = "alltoall"
    checks_ids_in_count_exchange = True

    def _announce_rejected_input(self) -> None:
        if self.ep.size > 1:  # the row/pair count exchange of _launch_dispatch, every count REJECTED
            send = torch.full((self.ep.size, 2), REJECTED, dtype=torch.int64, device=self._counts_device())
            dist.all_to_all_single(torch.empty_like(send), send, group=self.ep.group)

    def _launch_dispatch(self, inp: DispatchInput) -> Pending:
        x_TH, ids_TK, ep = inp.x_TH, inp.topk_ids_TK.long(), self.ep
        num_tokens, hidden = x_TH.shape
        # The id check rides on the count exchange: a rank with a bad id sends REJECTED counts.
        ids_ok, owner_TK = self._ids_in_range(ids_TK)
        is_sent_TP = torch.zeros(num_tokens, ep.size, dtype=torch.bool, device=x_TH.device)
        is_sent_TP.scatter_(1, owner_TK, True)
        # Counts per destination: rows, then (row, expert) pairs. Knowing the pairs it will receive
        # lets the receiver lay rows out by expert without reading the payload on the host.
        pairs_P = count_per_key(owner_TK.reshape(-1), ep.size)
        send_counts_P2 = torch.where(ids_ok, torch.stack([is_sent_TP.sum(dim=0), pairs_P], dim=1), REJECTED)
        recv_counts_P2 = torch.empty_like(send_counts_P2)
        dist.all_to_all_single(recv_counts_P2, send_counts_P2, group=ep.group)
        counts = torch.cat([send_counts_P2[:, 0], recv_counts_P2.t().reshape(-1)]).tolist()  # one sync
        self._raise_if_rejected([r for r in range(ep.size) if counts[ep.size + r] == REJECTED], ids_TK)
        send_counts = tuple(counts[: ep.size])
        recv_counts = tuple(counts[ep.size : 2 * ep.size])
        num_pairs = sum(counts[2 * ep.size :])
        # Rows in (destination rank, token) order: what all_to_all_single's splits expect. The row
        # count is known on the host now, so nonzero needs no second host sync.
        dest_M, send_token_M = nonzero_static(is_sent_TP.t(), sum(send_counts)).unbind(1)

        # Where each (token, rank) row went, for combine's sum of the returned rows (M: nowhere).
        slot_TP = torch.full((num_tokens, ep.size), dest_M.shape[0], dtype=torch.int64, device=x_TH.device)
        slot_TP[send_token_M, dest_M] = torch.arange(dest_M.shape[0], device=x_TH.device)

        # Ids are made local to the destination before sending, -1 where another rank owns them.
        local_ids_MK = self._local_ids(ids_TK[send_token_M], dest_M[:, None])
        send_meta = pack_topk(local_ids_MK, inp.topk_weights_TK[send_token_M])
        send_x = x_TH[send_token_M]
        recv_x = x_TH.new_empty(sum(recv_counts), hidden)
        recv_meta = send_meta.new_empty(sum(recv_counts), send_meta.shape[1])
        works = [
            dist.all_to_all_single(recv_x, send_x, list(recv_counts), list(send_counts), group=ep.group, async_op=True),
            dist.all_to_all_single(
                recv_meta, send_meta, list(recv_counts), list(send_counts), group=ep.group, async_op=True
            ),
        ]
        row_bytes = hidden * x_TH.element_size() + send_meta.shape[1] * 4
        traffic = Traffic(
            dispatch_bytes_sent=_remote(send_counts, ep.rank) * row_bytes,
            dispatch_bytes_recv=_remote(recv_counts, ep.rank) * row_bytes,
            dispatch_inter_node_sent=_other_nodes(send_counts, ep) * row_bytes,
        )
        state = _InFlightDispatch(recv_x, recv_meta, slot_TP, send_counts, recv_counts, num_pairs, num_tokens, traffic)
        return Pending(works=works, state=state)

    def _wait_dispatch(self, pending: Pending) -> DispatchOutput:
        pending.wait()
        s: _InFlightDispatch = pending.state
        local_ids_MK, weights_MK = unpack_topk(s.recv_meta_M2K)
        layout = group_rows_by_expert(local_ids_MK, weights_MK, self.num_local_experts, s.num_pairs)
        handle = AllToAllHandle(
            num_tokens=s.num_tokens,
            hidden_size=s.recv_x_MH.shape[1],
            dtype=s.recv_x_MH.dtype,
            layout=layout,
            traffic=s.traffic,
            slot_TP=s.slot_TP,
            send_counts=s.send_counts,
            recv_counts=s.recv_counts,
        )
        return self._output(s.recv_x_MH[layout.row_R], handle)

    def _launch_combine(self, inp: CombineInput) -> Pending:
        handle: AllToAllHandle = inp.handle  # type: ignore[assignment]
        # One row per received token row: the sum over this rank's experts, weighted.
        partial_MH = combine_rows(inp.expert_y_RH, handle.layout, handle.dtype)
        back_MH = partial_MH.new_empty(sum(handle.send_counts), handle.hidden_size)
        work = dist.all_to_all_single(
            back_MH, partial_MH, list(handle.send_counts), list(handle.recv_counts), group=self.ep.group, async_op=True
        )
        row_bytes = handle.hidden_size * partial_MH.element_size()
        traffic = Traffic(
            combine_bytes_sent=_remote(handle.recv_counts, self.ep.rank) * row_bytes,
            combine_bytes_recv=_remote(handle.send_counts, self.ep.rank) * row_bytes,
            combine_inter_node_sent=_other_nodes(handle.recv_counts, self.ep) * row_bytes,
        )
        return Pending(works=[work], state=back_MH, traffic=traffic)

    def _wait_combine(self, pending: Pending) -> torch.Tensor:
        pending.wait()
        handle: AllToAllHandle = pending.handle  # type: ignore[assignment]
        # Each token's returned rows (one per rank it went to), summed in float32 in rank order.
        return gather_sum(pending.state, handle.slot_TP, out_dtype=handle.dtype)
