"""``low_latency``'s execution paths: what a path is (``Path``, the four phases for one shape), the torch
path (``TorchPath``), and what the dispatcher keeps per shape (``ShapeSets``) and per round (``Round``).
The fused paths are ``fused.py``'s; the dispatcher's ``PATHS`` holds the rule table.

Legend: see ``moe_sbo/__init__.py``. Here S = P * C slots (C = ``max_tokens_per_rank``), B the
packed row's bytes (``wire.py``), R = S * K expert rows (padding included), Q = H / 128 fp8 scales.

    path          runs                                              supports                 inside a capture
    ReplayedPath  the fused kernels from each buffer set's index    fused kernels and        no: FusedPath runs
                  graphs (``graphs.py``, ``pieces.py``)             ``index_graphs``
    FusedPath     the fused kernels (``kernels/``), launched        fused kernels            yes
    TorchPath     the torch ops of ``reference.py``                 any device               yes

The dispatcher chooses once per (device, dtype, H, K), when it allocates the shape's buffers: the
first path of the table that supports the shape runs eager phases, the first that also runs inside
a caller's CUDA-graph capture runs captured ones. A round records the path its launch ran; its wait
runs that path, and so does its combine unless a caller's capture is recording it.

The hard part is what a path may hold: ``ShapeSets`` keeps it as long as the buffers, and a captured
index graph keeps the functions it calls, so a path holds the shape's fixed numbers (``PathSpec``),
never the dispatcher (a reference cycle would keep a deleted layer's buffers alive until the next
garbage collection); what may change between forwards (``deliver_fp8``) comes with each call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, cast

import torch

from ..records import DispatchInput, Traffic
from ..reduce import gather_sum
from .graphs import RoundGraphs
from .reference import FixedLayout, group_slots_by_expert, plan_send, reduce_pairs
from .transport import Buffers
from .wire import RowFormat

if TYPE_CHECKING:
    from .kernels import KernelLayout


@dataclass(frozen=True)
class PathSpec:
    """What every path of one shape knows: the row format, this rank and the group's size, the expert
    counts, the capacity C, and two options: ``in_place`` (``index_rows`` where the fused kernels run:
    the received rows stay in the receive buffer, fp8 rows only where delivered as fp8) and
    ``fixed_expert_rows``."""

    fmt: RowFormat
    rank: int
    num_ranks: int
    num_local_experts: int
    num_experts: int
    capacity: int
    in_place: bool
    fixed_expert_rows: bool

    @property
    def num_slots(self) -> int:
        return self.num_ranks * self.capacity

    def rows_in_place(self, keep_fp8: bool) -> bool:
        """Whether a round's rows stay in the receive buffer: ``in_place``, and for fp8 rows only when
        they are delivered as fp8 (``keep_fp8``); dequantised rows are copies."""
        return self.in_place and (not self.fmt.fp8 or keep_fp8)


@dataclass(slots=True)  # not frozen: built every forward, and a frozen init costs the host more
class Received:
    """What a dispatch's wait hands the experts. ``fixed``: the receiver's layout
    (``reference.FixedLayout`` on the torch path, ``kernels.KernelLayout`` on the fused ones);
    ``expert_x_RH`` [R, H] the expert rows in the activation dtype, or e4m3 with ``scales_RQ``
    float32 [R, Q] (``deliver_fp8`` and fp8 dispatch; else None); in place (``index_rows``) the
    receive buffer's rows [S + 1, H] (and scales [S + 1, Q]) instead, views, and ``rows_R`` int64 [R]
    each expert row's slot among them (S: the zero padding slot); else None."""

    fixed: FixedLayout | KernelLayout
    expert_x_RH: torch.Tensor
    scales_RQ: torch.Tensor | None = None
    rows_R: torch.Tensor | None = None


class Path:
    """One way to run the four phases for one shape (``spec``). ``supports`` says which shapes it
    serves and ``inside_capture`` whether it may run inside a caller's CUDA-graph capture (the
    rule table in the module docstring); the dispatcher picks, counts rounds and builds the handle.

    Sync (every phase): queued on the current stream with no host read of device data; a transfer's
    works are returned for the dispatcher to wait on (an NCCL all-to-all runs on the communicator's
    stream, a symmetric-memory phase ends with a barrier on the device)."""

    inside_capture: ClassVar[bool] = True

    def __init__(self, spec: PathSpec):
        self.spec = spec

    @staticmethod
    def supports(fused: bool, index_graphs: bool) -> bool:
        """Whether this path serves a shape where the fused kernels run (``fused``) or not, with the
        ``index_graphs`` option as given."""
        raise NotImplementedError

    def launch_dispatch(self, inp: DispatchInput, bufs: Buffers, graphs: RoundGraphs) -> tuple[torch.Tensor, list]:
        """Pack ``inp`` (x [T, H], topk_ids [T, K] int32/int64 in [-1, E), topk_weights [T, K]
        float; T <= C) into the round's blocks ``bufs`` (``graphs``: the set's index graphs) and
        start the transfer -> (``slot_TP`` int64 [T, P]: the slot ``p * C + row`` of token t's row
        in block p, S where t sends nothing to p; the works to wait on)."""
        raise NotImplementedError

    def wait_dispatch(self, r: Round, keep_fp8: bool) -> Received:
        """After the transfer: lay the received S slots out expert-major (real rows first, counts on
        the device). ``keep_fp8``: ``deliver_fp8`` (hand fp8 rows over as they arrived)."""
        raise NotImplementedError

    def launch_combine(self, expert_y_RH: torch.Tensor, r: Round, fixed: FixedLayout | KernelLayout) -> list:
        """Each slot's weighted sum of its local experts' outputs ``expert_y_RH`` [R, H] (padding rows
        undefined, masked) over the dispatch's layout ``fixed``, into the round's blocks; start the
        transfer -> the works to wait on."""
        raise NotImplementedError

    def wait_combine(self, r: Round, out: torch.Tensor | None = None) -> torch.Tensor:
        """After the transfer: each token's P returned rows summed in float32 -> y [T, H] in the
        activation dtype (into ``out`` when given)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ShapeSets:
    """The buffer sets of one (device, activation dtype, H, K), and what every forward of that shape
    would otherwise derive again: the row format, the path of an eager phase (``path``) and of a
    phase inside a caller's capture (``capture_path``), the bytes each phase moves.

    Built on the shape's first forward (which allocates the buffers) and looked up once per dispatch
    after: an eager decode step's dispatch is host-bound, so what is fixed is not recomputed.
    ``graphs[i]`` are buffer set ``i``'s index graphs (``graphs.py``), built on first use."""

    fmt: RowFormat
    buffers: list[Buffers]
    graphs: list[RoundGraphs]
    path: Path
    capture_path: Path
    dispatch_traffic: Traffic
    combine_traffic: Traffic


@dataclass(slots=True)  # not frozen: built every forward, and a frozen init costs the host more
class Round:
    """One dispatch round, as its launch fixed it: the shape's ``sets``, the ``path`` the launch ran,
    the buffer set it took and that set's index graphs, its ``generation`` (the round count at
    launch), the sender's ``slot_TP`` (where each token's rows went) and T; ``packed_rows``: set
    when ``packed.pack_rows`` rewrote the round's layout, the rows of the packed layout its combine
    then reads the experts' outputs from (None: the R grouped rows)."""

    sets: ShapeSets
    path: Path
    slot_TP: torch.Tensor
    buffers: Buffers
    graphs: RoundGraphs
    generation: int
    num_tokens: int
    packed_rows: int | None = None


class TorchPath(Path):
    """``reference.py``'s chains of torch ops, on any device: the same bytes on the wire and the same
    layout as the fused kernels. The receiver's gather and combine's reduction touch all R rows."""

    @staticmethod
    def supports(fused: bool, index_graphs: bool) -> bool:
        return True

    def launch_dispatch(self, inp: DispatchInput, bufs: Buffers, graphs: RoundGraphs) -> tuple[torch.Tensor, list]:
        s = self.spec
        plan = plan_send(inp.topk_ids_TK, s.num_local_experts, s.num_ranks, s.capacity)
        rows_TB = s.fmt.pack(inp.x_TH, inp.topk_ids_TK, inp.topk_weights_TK)
        torch.index_select(rows_TB, 0, plan.token_S, out=bufs.dispatch_send_SB)
        return plan.slot_TP, bufs.dispatch_exchange.start()

    def wait_dispatch(self, r: Round, keep_fp8: bool) -> Received:
        s, fmt = self.spec, self.spec.fmt
        recv_SB = r.buffers.dispatch_recv_SB
        received_SB = recv_SB[: s.num_slots]
        # Global ids -> ids of this rank's experts, -1 for other ranks' experts.
        local_SK = fmt.ids(received_SB).long() - s.rank * s.num_local_experts
        local_ids_SK = torch.where((local_SK >= 0) & (local_SK < s.num_local_experts), local_SK, -1)
        fixed = group_slots_by_expert(local_ids_SK, fmt.weights(received_SB), s.num_local_experts)
        # x of all S + 1 rows (the last is the zero padding slot), then one gather into expert order.
        if keep_fp8 and fmt.fp8:
            q_SH, scales_SQ = fmt.x_fp8(recv_SB)
            return Received(fixed, q_SH[fixed.layout.row_R], scales_SQ[fixed.layout.row_R])
        return Received(fixed, fmt.x(recv_SB)[fixed.layout.row_R])

    def launch_combine(self, expert_y_RH: torch.Tensor, r: Round, fixed: FixedLayout | KernelLayout) -> list:
        bufs = r.buffers
        bufs.combine_send_SH.copy_(reduce_pairs(expert_y_RH, cast(FixedLayout, fixed)))
        return bufs.combine_exchange.start()

    def wait_combine(self, r: Round, out: torch.Tensor | None = None) -> torch.Tensor:
        # Each token's P returned rows (slot S where it sent nothing), summed in float32 in a fixed order.
        dtype = self.spec.fmt.dtype
        return gather_sum(r.buffers.combine_slots_SH, r.slot_TP, out_dtype=dtype, kernels="torch", out=out)
