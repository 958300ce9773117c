"""The records a dispatcher's phases hand on: the hooks' payloads, the handle combine needs,
and the bytes each phase moved (``Traffic``).

Legend: see ``moe_sbo/__init__.py``. ``dispatch/base.py`` says which phase makes and reads each.

The hard part is when each is written. Every record is frozen but ``Pending``, the transfer on the
wire: its wait drops the async works, and ``combine_launch`` sets its ``handle``. The bytes a
dispatch moved go into its ``DispatchHandle`` when the dispatch ends; ``combine_wait`` adds the
combine's (``Pending.traffic``, set at launch) to them in ``Dispatcher.last_traffic``, so a handle
never changes after it is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .layout import ExpertLayout


@dataclass(frozen=True)
class Traffic:
    """Bytes this rank put on / took off the wire (its own rank's share excluded): one phase's, or
    a forward's (the sum of its two phases), or two micro-batches' (their sum)."""

    dispatch_bytes_sent: int = 0
    dispatch_bytes_recv: int = 0
    combine_bytes_sent: int = 0
    combine_bytes_recv: int = 0
    # Of the bytes sent, those that crossed to another node (``EPGroup.ranks_per_node``).
    dispatch_inter_node_sent: int = 0
    combine_inter_node_sent: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        # Field by field, spelled out: every combine adds two (dataclasses.fields costs the host more).
        return Traffic(
            self.dispatch_bytes_sent + other.dispatch_bytes_sent,
            self.dispatch_bytes_recv + other.dispatch_bytes_recv,
            self.combine_bytes_sent + other.combine_bytes_sent,
            self.combine_bytes_recv + other.combine_bytes_recv,
            self.dispatch_inter_node_sent + other.dispatch_inter_node_sent,
            self.combine_inter_node_sent + other.combine_inter_node_sent,
        )

    @property
    def inter_node_bytes(self) -> int:
        """Bytes this rank sent to other nodes (both phases)."""
        return self.dispatch_inter_node_sent + self.combine_inter_node_sent

    @property
    def intra_node_bytes(self) -> int:
        """Bytes this rank sent to other ranks of its own node (both phases)."""
        return self.bytes_sent - self.inter_node_bytes

    @property
    def bytes_sent(self) -> int:
        return self.dispatch_bytes_sent + self.combine_bytes_sent

    @property
    def bytes_recv(self) -> int:
        return self.dispatch_bytes_recv + self.combine_bytes_recv


@dataclass(frozen=True)
class DispatchInput:
    """Payload of ``pre_dispatch``: ``x_TH``, ``topk_ids_TK`` (int, in [0, E)), ``topk_weights_TK``."""

    x_TH: torch.Tensor
    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to undo a dispatch. Schemes subclass it with their own fields.

    ``traffic``: the bytes the dispatch phase moved (recorded when it ended).
    """

    num_tokens: int
    hidden_size: int
    dtype: torch.dtype
    layout: ExpertLayout
    traffic: Traffic


@dataclass(frozen=True)
class DispatchOutput:
    """Payload of ``post_dispatch``: rows for the local experts, grouped by expert.

    ``expert_x_RH`` [R, H]; ``num_rows_per_expert_L`` int64 [L] on the same device; ``handle`` for
    combine. ``expert_scales_RQ``: None, or (when the dispatcher ``deliver_fp8``) float32 [R, H/128]
    and ``expert_x_RH`` is e4m3, as it came off the wire (``quant/fp8.py``'s activation format).
    ``expected_rows``: where padding rows follow the real ones (``low_latency``'s fixed layout), how
    many real rows to expect without reading the counts (what the experts choose their kernels by);
    None when every row is real.

    ``expert_rows_R``: None, or (``low_latency`` with ``index_rows``) an int64 [R] index: the rows
    were not copied into expert order, ``expert_x_RH`` is then [X, H] (a view of the receive buffer;
    ``expert_scales_RQ`` [X, Q] likewise) and row r of the experts' input is
    ``expert_x_RH[expert_rows_R[r]]``. ``RoutedExperts`` takes
    it as ``rows_R`` (its tiled GEMM reads through it); ``rows_RH()`` gives the rows in expert order
    either way.
    """

    expert_x_RH: torch.Tensor
    num_rows_per_expert_L: torch.Tensor
    handle: DispatchHandle
    expert_scales_RQ: torch.Tensor | None = None
    expected_rows: int | None = None
    expert_rows_R: torch.Tensor | None = None

    def rows_RH(self) -> torch.Tensor:
        """The experts' input rows [R, H] in expert order: ``expert_x_RH`` itself, or gathered
        through ``expert_rows_R`` (a copy, on the current stream)."""
        if self.expert_rows_R is None:
            return self.expert_x_RH
        return self.expert_x_RH.index_select(0, self.expert_rows_R)


@dataclass(frozen=True)
class CombineInput:
    """Payload of ``pre_combine``: ``expert_y_RH`` the local experts' outputs, in dispatch order."""

    expert_y_RH: torch.Tensor
    handle: DispatchHandle


@dataclass
class Pending:
    """A transfer on the wire (payload of the ``*_in_flight`` hooks): async works plus scheme state,
    and ``traffic``, the bytes this phase moves (known at launch)."""

    works: list[Any]
    state: Any
    handle: DispatchHandle | None = None
    traffic: Traffic = Traffic()

    @property
    def dispatch_handle(self) -> DispatchHandle:
        """The handle of the dispatch this transfer belongs to (set at launch for combine)."""
        assert self.handle is not None, "a combine's Pending carries its dispatch handle from combine_launch"
        return self.handle

    def wait(self) -> None:
        """Block until the transfer is done (CPU), or make the current stream wait for it (CUDA)."""
        for work in self.works:
            work.wait()
        self.works = []
