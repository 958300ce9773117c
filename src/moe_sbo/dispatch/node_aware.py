"""``node_aware``: dispatch and combine in two legs, so that a token crosses to each destination node
once (DeepEP's internode scheme).

::

    dispatch  leg 1 (across nodes, rail group): token -> the rank with the same local index on each
                     node that owns one of its experts, with the top-k ids that live on that node
              leg 2 (inside the node, node group): that rank forwards the row to its node's ranks that
                     own the experts (once per rank, as ``alltoall`` does)
    combine   leg 2 back: each expert rank returns one weighted partial sum per row; the forwarding rank
                     sums them (rank order)
              leg 1 back: one partial sum per (token, node) crosses back; the sender sums them (node order)

Ranks ``n * G .. n * G + G - 1`` form node n (``ranks_per_node`` G: the option, else the EP group's,
``MOE_SBO_RANKS_PER_NODE`` or torchrun's ``LOCAL_WORLD_SIZE``). Leg 1 runs over the *rail* group (ranks
with one local index: the same NIC rail in a cluster), leg 2 over the *node* group (NVLink), each a
process group of its own, so their transfers run on separate communicators.

The hard part is keeping every contract of a dispatcher with two data-dependent exchanges. The ids are
checked inside the first count exchange, which spans the whole EP group so that every rank learns of a
rejected input before any payload moves (a rank on another rail would otherwise wait in leg 2 for a
peer that already raised). Each phase's in-flight window (the hooks SBO attaches to) is the inter-node
leg, the slow one: dispatch launches leg 1 and leaves it in flight, its wait runs leg 2; combine runs
leg 2 back in its launch and leaves leg 1 back in flight. Both sums run in a fixed order, so the output
is the same bits run to run (and equals the flat dispatchers' up to the summation order).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import env
from .base import REJECTED, Dispatcher, EPGroup, register_dispatcher
from .layout import combine_rows, count_per_key, group_rows_by_expert, nonzero_static, pack_topk, unpack_topk
from .records import CombineInput, DispatchHandle, DispatchInput, DispatchOutput, Pending, Traffic
from .reduce import gather_sum


@dataclass(frozen=True)
class Leg:
    """One exchange of rows over a group of D ranks: ``slot_YD`` int64 [Y, D] which sent row carried
    source row y to member d (the sent count where none did); rows sent to / received from each member."""

    slot_YD: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]

    def remote_sent(self, me: int) -> int:
        return sum(self.send_counts) - self.send_counts[me]

    def remote_recv(self, me: int) -> int:
        return sum(self.recv_counts) - self.recv_counts[me]


@dataclass(frozen=True, kw_only=True)
class NodeAwareHandle(DispatchHandle):
    """Per token chunk: ``across``, leg 1 (tokens -> nodes, over the rail group), and ``inside``, leg 2
    (leg 1's received rows -> this node's ranks, over the node group); ``token_chunks`` the chunks'
    first token; the experts' rows are the chunks' leg-2 rows one after the other."""

    across: tuple[Leg, ...]
    inside: tuple[Leg, ...]
    token_chunks: tuple[int, ...]


@dataclass(frozen=True)
class _Across:
    """One chunk's leg 1 in flight: its receive buffers and transfers."""

    leg: Leg
    recv_x_MH: torch.Tensor
    recv_meta_M2K: torch.Tensor
    works: list[Any]


def _rows_by_member(is_sent_YD: torch.Tensor, num_sent: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sent rows in (member, source row) order, as ``all_to_all_single``'s splits expect: (member of
    each sent row, its source row, ``slot_YD``). ``num_sent`` is known on the host: no sync here."""
    member_S, source_S = nonzero_static(is_sent_YD.t(), num_sent).unbind(1)
    slot_YD = torch.full(is_sent_YD.shape, num_sent, dtype=torch.int64, device=is_sent_YD.device)
    slot_YD[source_S, member_S] = torch.arange(num_sent, device=is_sent_YD.device)
    return member_S, source_S, slot_YD


def _exchange(recv: torch.Tensor, send: torch.Tensor, leg_recv, leg_send, group, size: int, async_op: bool):
    """``all_to_all_single`` over ``group`` (a plain copy in a group of one); its work, or None."""
    if size == 1:
        recv.copy_(send)
        return None
    return dist.all_to_all_single(recv, send, list(leg_recv), list(leg_send), group=group, async_op=async_op)


# Process groups this process made for node_aware, by (default group, ranks): made once and shared by
# every dispatcher over the same ranks. A layer per model layer, or a new layer per test case, would
# otherwise open groups never closed; and PyTorch names a locally synchronised group after its ranks
# alone, so a second group over the same ranks would share the first one's rendezvous keys.
_SUBGROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}


def _subgroup(ep: EPGroup, members: tuple[int, ...], ranks: tuple[int, ...]) -> Any:
    """The group of ``ranks`` (global ranks): the EP group itself when they are all of it."""
    if ranks == members:
        return ep.group
    key = (id(dist.distributed_c10d._get_default_group()), ranks)
    if key not in _SUBGROUPS:
        # The process's wait bound, as the group that joined had it (a new group's default is PyTorch's
        # 10 or 30 minutes): a dead peer in either leg is reported as in every other collective.
        timeout = datetime.timedelta(seconds=env.collective_timeout_s())
        _SUBGROUPS[key] = dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=True)
    return _SUBGROUPS[key]


def clear_subgroups() -> None:
    """Forget the groups ``_subgroup`` made: for a process that destroys its groups to re-form without
    a lost rank (``launch/elastic.py``). A gloo group closes its connections only when the last
    reference to it goes, and a peer blocked in it fails only then."""
    _SUBGROUPS.clear()


def leg_groups(ep: EPGroup, ranks_per_node: int) -> tuple[Any, Any]:
    """(node group, rail group) of this rank: the ranks of its node, and the ranks with its local index
    on every node (None where it would hold this rank alone). Each rank makes only the groups it
    belongs to (local synchronisation: the other ranks need not take part), the node's first, then
    the rail's, so the members of a group make it together."""
    members = tuple(dist.get_process_group_ranks(ep.group) if ep.group is not None else range(ep.size))
    node, local = divmod(ep.rank, ranks_per_node)
    node_group: Any = None
    rail_group: Any = None
    if ranks_per_node > 1:
        node_group = _subgroup(ep, members, members[node * ranks_per_node : (node + 1) * ranks_per_node])
    if ep.size > ranks_per_node:
        rail_group = _subgroup(ep, members, members[local::ranks_per_node])
    return node_group, rail_group


def _wait_all(works: list[Any]) -> None:
    for work in works:
        if work is not None:
            work.wait()


@register_dispatcher
class NodeAwareDispatcher(Dispatcher):
    """Tokens cross to each destination node once, to the same-rail rank, which forwards them inside
    its node; combine reduces inside the node before crossing back. ``ranks_per_node``: ranks of one
    node (default: the EP group's, see ``EPGroup.ranks_per_node``). ``chunks``: the tokens go in this
    many chunks, every chunk's leg 1 launched at once, so that while a rank forwards chunk c inside its
    node (leg 2, the node group) chunks c + 1.. still cross (leg 1, the rail group); combine likewise
    sends chunk c back across while it reduces chunk c + 1 inside the node. Leg 1's counts for every
    chunk go in one exchange; each chunk costs leg 2 one more (a host read each)."""

    name = "node_aware"
    checks_ids_in_count_exchange = True

    def __init__(self, num_experts: int, ep: EPGroup, *, ranks_per_node: int | None = None, chunks: int = 1):
        if ranks_per_node is not None:
            ep = EPGroup(ep.group, ep.rank, ep.size, ranks_per_node)  # checks that it divides the size
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        super().__init__(num_experts, ep)
        g = ep.node_size
        self.ranks_per_node, self.num_nodes, self.chunks = g, ep.size // g, chunks
        self.node, self.local_rank = divmod(ep.rank, g)
        self.node_group: Any = None
        self.rail_group: Any = None
        if ep.size > 1:
            self.node_group, self.rail_group = leg_groups(ep, g)

    def _announce_rejected_input(self) -> None:
        if self.ep.size > 1:  # the first count exchange of _launch_dispatch, every count REJECTED
            send = torch.full((self.ep.size * self.chunks,), REJECTED, dtype=torch.int64, device=self._counts_device())
            dist.all_to_all_single(torch.empty_like(send), send, group=self.ep.group)

    # ---- dispatch ---------------------------------------------------------------------------------

    def _launch_dispatch(self, inp: DispatchInput) -> Pending:
        x_TH, ids_TK, g = inp.x_TH, inp.topk_ids_TK.long(), self.ranks_per_node
        num_tokens, hidden = x_TH.shape
        ids_ok, owner_TK = self._ids_in_range(ids_TK)
        node_TK = torch.div(owner_TK, g, rounding_mode="floor")
        is_sent_TN = torch.zeros(num_tokens, self.num_nodes, dtype=torch.bool, device=x_TH.device)
        is_sent_TN.scatter_(1, node_TK, True)
        bounds = [num_tokens * c // self.chunks for c in range(self.chunks + 1)]
        rows_CN = torch.stack([is_sent_TN[a:b].sum(dim=0) for a, b in zip(bounds, bounds[1:])])
        counts = self._exchange_counts_across(rows_CN, ids_ok, ids_TK)
        across = []
        for c, (send_counts, recv_counts) in enumerate(counts):
            a = bounds[c]
            node_S, token_S, slot_TN = _rows_by_member(is_sent_TN[a : bounds[c + 1]], sum(send_counts))
            token_S = token_S + a
            # Each node gets the ids of the experts it holds, -1 for the others (they go elsewhere).
            ids_SK = torch.where(node_TK[token_S] == node_S[:, None], ids_TK[token_S], -1)
            send_meta = pack_topk(ids_SK, inp.topk_weights_TK[token_S])
            leg = Leg(slot_TN, send_counts, recv_counts)
            recv_x = x_TH.new_empty(sum(recv_counts), hidden)
            recv_meta = send_meta.new_empty(sum(recv_counts), send_meta.shape[1])
            works = [
                _exchange(recv_x, x_TH[token_S], recv_counts, send_counts, self.rail_group, self.num_nodes, True),
                _exchange(recv_meta, send_meta, recv_counts, send_counts, self.rail_group, self.num_nodes, True),
            ]
            across.append(_Across(leg, recv_x, recv_meta, works))
        return Pending(works=[], state=(across, tuple(bounds[:-1]), num_tokens))

    def _exchange_counts_across(
        self, rows_CN: torch.Tensor, ids_ok: torch.Tensor, ids_TK: torch.Tensor
    ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Leg 1's row counts per chunk (to / from each node's same-rail rank), exchanged over the whole
        EP group with REJECTED in place of the counts of a rank whose ids are out of range; one host read."""
        ep, g, chunks = self.ep, self.ranks_per_node, self.chunks
        if ep.size == 1:
            if not bool(ids_ok):
                self._raise_if_rejected([0], ids_TK)
            return [((int(n),), (int(n),)) for n in rows_CN[:, 0].tolist()]
        send_WC = torch.zeros(ep.size, chunks, dtype=torch.int64, device=self._counts_device())
        send_WC[self.local_rank :: g] = rows_CN.t().to(send_WC.device)
        send_WC = torch.where(ids_ok.to(send_WC.device), send_WC, REJECTED)
        recv_WC = torch.empty_like(send_WC)
        dist.all_to_all_single(recv_WC, send_WC, group=ep.group)
        sent, received = rows_CN.tolist(), recv_WC.tolist()  # [C][N] and [W][C]
        self._raise_if_rejected([r for r in range(ep.size) if REJECTED in received[r]], ids_TK)
        rail = received[self.local_rank :: g]
        return [(tuple(sent[c]), tuple(rail[n][c] for n in range(self.num_nodes))) for c in range(chunks)]

    def _wait_dispatch(self, pending: Pending) -> DispatchOutput:
        across_chunks, token_chunks, num_tokens = pending.state
        inside_legs, xs, metas, num_pairs = [], [], [], 0
        for chunk in across_chunks:  # chunk c moves inside the node while later chunks still cross
            _wait_all(chunk.works)
            leg, x, meta, pairs = self._forward_inside(chunk.recv_x_MH, chunk.recv_meta_M2K)
            inside_legs.append(leg)
            xs.append(x)
            metas.append(meta)
            num_pairs += pairs
        recv_x = torch.cat(xs) if len(xs) > 1 else xs[0]
        local_ids, weights = unpack_topk(torch.cat(metas) if len(metas) > 1 else metas[0])
        layout = group_rows_by_expert(local_ids, weights, self.num_local_experts, num_pairs)
        row_bytes = recv_x.shape[1] * recv_x.element_size() + metas[0].shape[1] * metas[0].element_size()
        crossed_sent = sum(c.leg.remote_sent(self.node) for c in across_chunks)
        crossed_recv = sum(c.leg.remote_recv(self.node) for c in across_chunks)
        traffic = Traffic(
            dispatch_bytes_sent=(crossed_sent + sum(i.remote_sent(self.local_rank) for i in inside_legs)) * row_bytes,
            dispatch_bytes_recv=(crossed_recv + sum(i.remote_recv(self.local_rank) for i in inside_legs)) * row_bytes,
            dispatch_inter_node_sent=crossed_sent * row_bytes,
        )
        handle = NodeAwareHandle(
            num_tokens=num_tokens,
            hidden_size=recv_x.shape[1],
            dtype=recv_x.dtype,
            layout=layout,
            traffic=traffic,
            across=tuple(c.leg for c in across_chunks),
            inside=tuple(inside_legs),
            token_chunks=token_chunks,
        )
        return self._output(recv_x[layout.row_R], handle)

    def _forward_inside(
        self, x_MH: torch.Tensor, meta_M2K: torch.Tensor
    ) -> tuple[Leg, torch.Tensor, torch.Tensor, int]:
        """Leg 2 of one chunk: rows that crossed (or stayed on this node) to the node's ranks owning
        their experts, with ids made local to each; returns (the leg, rows and packed ids received,
        (row, expert) pairs received)."""
        g = self.ranks_per_node
        ids_MK, weights_MK = unpack_topk(meta_M2K)
        member_MK = torch.where(ids_MK >= 0, torch.div(ids_MK, self.num_local_experts, rounding_mode="floor") % g, g)
        # Column g takes the choices this node does not hold; scatter as alltoall marks its ranks.
        is_sent_MG = torch.zeros(ids_MK.shape[0], g + 1, dtype=torch.bool, device=ids_MK.device)
        is_sent_MG = is_sent_MG.scatter_(1, member_MK, True)[:, :g]
        pairs_G = count_per_key(member_MK.reshape(-1), g + 1)[:g]
        send_counts, recv_counts, num_pairs = self._exchange_counts_inside(is_sent_MG.sum(dim=0), pairs_G)
        member_S, row_S, slot_MG = _rows_by_member(is_sent_MG, sum(send_counts))
        owner_S = self.node * g + member_S
        send_meta = pack_topk(self._local_ids(ids_MK[row_S], owner_S[:, None]), weights_MK[row_S])
        send_x = x_MH[row_S]
        recv_x = send_x.new_empty(sum(recv_counts), send_x.shape[1])
        recv_meta = send_meta.new_empty(sum(recv_counts), send_meta.shape[1])
        for recv, send in ((recv_x, send_x), (recv_meta, send_meta)):
            _exchange(recv, send, recv_counts, send_counts, self.node_group, g, async_op=False)
        return Leg(slot_MG, send_counts, recv_counts), recv_x, recv_meta, num_pairs

    def _exchange_counts_inside(
        self, rows_G: torch.Tensor, pairs_G: torch.Tensor
    ) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """Leg 2's row counts to / from each rank of the node, and the (row, expert) pairs this rank
        will receive; one host read."""
        g = self.ranks_per_node
        send_G2 = torch.stack([rows_G, pairs_G], dim=1)
        if g == 1:
            counts = send_G2.reshape(-1).tolist()
            return (counts[0],), (counts[0],), counts[1]
        send_G2 = send_G2.to(self._counts_device())
        recv_G2 = torch.empty_like(send_G2)
        dist.all_to_all_single(recv_G2, send_G2, group=self.node_group)
        counts = torch.cat([send_G2[:, 0], recv_G2.t().reshape(-1)]).tolist()
        return tuple(counts[:g]), tuple(counts[g : 2 * g]), sum(counts[2 * g :])

    # ---- combine ----------------------------------------------------------------------------------

    def _launch_combine(self, inp: CombineInput) -> Pending:
        handle: NodeAwareHandle = inp.handle  # type: ignore[assignment]
        # One weighted partial sum per row this rank's experts saw, every chunk's rows one after another.
        partial_MH = combine_rows(inp.expert_y_RH, handle.layout, handle.dtype)
        homes, works, first = [], [], 0
        for inside, across in zip(handle.inside, handle.across):
            rows = sum(inside.recv_counts)
            # Leg 2 back, to the forwarding rank, which sums this node's experts in rank order; then
            # one row per (token, node) crosses back while the next chunk is reduced.
            back_MH = partial_MH.new_empty(sum(inside.send_counts), handle.hidden_size)
            chunk_MH = partial_MH[first : first + rows]
            _exchange(
                back_MH, chunk_MH, inside.send_counts, inside.recv_counts, self.node_group, self.ranks_per_node, False
            )
            first += rows
            node_sum_MH = gather_sum(back_MH, inside.slot_YD, out_dtype=handle.dtype)
            home_MH = node_sum_MH.new_empty(sum(across.send_counts), handle.hidden_size)
            homes.append(home_MH)
            works.append(
                _exchange(
                    home_MH, node_sum_MH, across.send_counts, across.recv_counts, self.rail_group, self.num_nodes, True
                )
            )
        row_bytes = handle.hidden_size * partial_MH.element_size()
        crossed = sum(a.remote_recv(self.node) for a in handle.across) * row_bytes
        inside_sent = sum(i.remote_recv(self.local_rank) for i in handle.inside) * row_bytes
        inside_recv = sum(i.remote_sent(self.local_rank) for i in handle.inside) * row_bytes
        traffic = Traffic(
            combine_bytes_sent=crossed + inside_sent,
            combine_bytes_recv=sum(a.remote_sent(self.node) for a in handle.across) * row_bytes + inside_recv,
            combine_inter_node_sent=crossed,
        )
        return Pending(works=[w for w in works if w is not None], state=homes, traffic=traffic)

    def _wait_combine(self, pending: Pending) -> torch.Tensor:
        pending.wait()
        handle: NodeAwareHandle = pending.handle  # type: ignore[assignment]
        # Each token's returned rows (one per node it went to), summed in float32 in node order.
        sums = [gather_sum(home, a.slot_YD, out_dtype=handle.dtype) for home, a in zip(pending.state, handle.across)]
        return torch.cat(sums) if len(sums) > 1 else sums[0]
