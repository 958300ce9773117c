"""``low_latency``'s two paths of the fused Triton kernels (``kernels/``): ``FusedPath`` launches them
each phase; ``ReplayedPath`` replays them from each buffer set's index graphs (``graphs.py``, built by
``pieces.py``), so an eager phase costs the host a replay or two at any T.

Legend: see ``paths.py``. This module imports Triton (through ``kernels/``); where it does not
import, only ``paths.TorchPath`` runs.

The hard part is that the two share kernels but not buffers: ``FusedPath`` writes what each forward
allocates, ``ReplayedPath`` the set's staging and the tensors its graphs captured, reaching the
caller's tensors through address tables (``addresses.py``). A caller's own capture cannot record a
replay, so there the shape's ``FusedPath`` runs instead (``ShapeSets.capture_path``); the kernels'
one-pass or two-pass plan (``kernels.two_pass``) is fixed per shape, when the path is made.
"""

from __future__ import annotations

from typing import ClassVar, cast

import torch

from ..records import DispatchInput
from ..reduce import gather_sum
from .addresses import readable
from .graphs import RoundGraphs, Staging
from .kernels import KernelLayout, expert_layout, expert_rows, gather_rows, pack_rows_checked, reduce_pairs, two_pass
from .paths import Path, PathSpec, Received, Round
from .pieces import combine_end_graph, combine_graph, layout_graph, pack_graph
from .reference import FixedLayout
from .transport import Buffers
from .wire import RowFormat


def received_rows(recv_SB: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The receive buffer's rows [S + 1, H] as the experts read them in place: activation-dtype
    values, or e4m3 values and their float32 scales [S + 1, Q] (views, rows strided by the wire's)."""
    return fmt.x_fp8(recv_SB) if fmt.fp8 else (fmt.x(recv_SB), None)


class FusedPath(Path):
    """The five fused kernels launched each phase: ``pack_rows_checked``, ``expert_layout`` and
    ``gather_rows`` (none with ``in_place``), ``reduce_pairs``, ``gather_sum``. They read the device
    count and skip the padding rows; the pack kernel checks every id it reads."""

    def __init__(self, spec: PathSpec):
        super().__init__(spec)
        self.two_pass = two_pass(spec.capacity)

    @staticmethod
    def supports(fused: bool, index_graphs: bool) -> bool:
        return fused

    def launch_dispatch(self, inp: DispatchInput, bufs: Buffers, graphs: RoundGraphs) -> tuple[torch.Tensor, list]:
        s, x_TH = self.spec, inp.x_TH
        assert bufs.dispatch_dst is not None, "buffers made where Triton imports have destinations"
        slot_TP = torch.empty(x_TH.shape[0], s.num_ranks, dtype=torch.int64, device=x_TH.device)
        pack_rows_checked(
            x_TH.contiguous(),
            inp.topk_ids_TK.contiguous(),
            inp.topk_weights_TK.float().contiguous(),
            bufs.dispatch_dst,
            slot_TP,
            s.fmt,
            s.num_local_experts,
            s.capacity,
            s.num_experts,
            self.two_pass,
        )
        return slot_TP, bufs.dispatch_exchange.start()

    def wait_dispatch(self, r: Round, keep_fp8: bool) -> Received:
        s, recv_SB = self.spec, r.buffers.dispatch_recv_SB
        fixed = expert_layout(recv_SB[: s.num_slots], s.fmt, s.rank, s.num_local_experts, self.two_pass)
        if self.spec.rows_in_place(keep_fp8):  # every row's source: its slot, or the zero slot S for padding
            x_SH, scales_SQ = received_rows(recv_SB, s.fmt)
            return Received(fixed, x_SH, scales_SQ, fixed.layout.row_R)
        expert_x_RH, scales_RQ = gather_rows(recv_SB, fixed, s.fmt, keep_fp8=keep_fp8)
        return Received(fixed, expert_x_RH, scales_RQ)

    def launch_combine(self, expert_y_RH: torch.Tensor, r: Round, fixed: FixedLayout | KernelLayout) -> list:
        bufs, fmt = r.buffers, self.spec.fmt
        assert bufs.combine_dst is not None, "buffers made where Triton imports have destinations"
        reduce_pairs(
            expert_y_RH.to(fmt.dtype).contiguous(),  # the blocks hold the activation dtype
            cast(KernelLayout, fixed),
            bufs.dispatch_recv_SB,
            fmt,
            bufs.combine_dst,
            self.spec.capacity,
        )
        return bufs.combine_exchange.start()

    def wait_combine(self, r: Round, out: torch.Tensor | None = None) -> torch.Tensor:
        # Each token's P returned rows (slot S where it sent nothing), summed in float32 in a fixed order.
        dtype = self.spec.fmt.dtype
        return gather_sum(r.buffers.combine_slots_SH, r.slot_TP, out_dtype=dtype, kernels="triton", out=out)


class ReplayedPath(Path):
    """The fused kernels from four CUDA graphs per buffer set (``pack``, ``layout``, ``combine``,
    ``combine_end``), each captured on its first call and replayed after (on CPU, Triton's
    interpreter, run without capture). With symmetric memory a transfer's start is captured in the
    ``pack`` and ``combine`` graphs and its end (the barrier) in ``layout`` and ``combine_end``, so
    no works are returned; an NCCL collective stays outside the graphs."""

    inside_capture: ClassVar[bool] = False

    def __init__(self, spec: PathSpec):
        super().__init__(spec)
        self.two_pass = two_pass(spec.capacity)

    @staticmethod
    def supports(fused: bool, index_graphs: bool) -> bool:
        return fused and index_graphs

    def launch_dispatch(self, inp: DispatchInput, bufs: Buffers, graphs: RoundGraphs) -> tuple[torch.Tensor, list]:
        """Through the set's ``pack`` graph (``pieces.pack_graph``), which stages the caller's
        tensors itself; ``slot_TP`` is a view of the set's ``slot_CP``, valid until the set's
        buffers are reused."""
        s, fmt = self.spec, self.spec.fmt
        if graphs.staging is None:
            graphs.staging = Staging.allocate(
                s.capacity, fmt.hidden, fmt.top_k, s.num_ranks, fmt.dtype, inp.x_TH.device
            )
        st = graphs.staging
        if graphs.pack is None:
            graphs.pack = pack_graph(
                bufs,
                st,
                fmt,
                num_local_experts=s.num_local_experts,
                num_experts=s.num_experts,
                capacity=s.capacity,
                two_pass=self.two_pass,
            )
        table = graphs.pack.addresses
        assert table is not None  # made with the pack graph
        values, read = st.pack_values(table, inp.x_TH, inp.topk_ids_TK, inp.topk_weights_TK)  # read: held until queued
        graphs.pack(*values)
        works = [] if bufs.dispatch_barrier is not None else bufs.dispatch_exchange.start()
        return st.slot_TP(values[0]), works

    def wait_dispatch(self, r: Round, keep_fp8: bool) -> Received:
        """The set's ``layout`` graph (``pieces.layout_graph``): first the end of a symmetric-memory
        transfer (the barrier) when ``pack`` started one, then (unless ``in_place``) the gather of
        the rows into tensors made here for this forward, or with ``fixed_expert_rows`` into the
        set's own (valid until its next round, ``num_buffers`` dispatches later, as the layout and
        the received rows are). Captured again if ``keep_fp8`` or ``in_place`` changed since (and
        the set's ``combine`` graph with it: it reads the layout's tensors)."""
        s, fmt, graphs = self.spec, self.spec.fmt, r.graphs
        recv_SB = r.buffers.dispatch_recv_SB
        in_place = s.rows_in_place(keep_fp8)
        built_for = (keep_fp8, in_place)
        if graphs.layout is None or graphs.layout_built_for != built_for:
            graphs.layout = layout_graph(
                r.buffers,
                fmt,
                rank=s.rank,
                num_local_experts=s.num_local_experts,
                num_slots=s.num_slots,
                two_pass=self.two_pass,
                keep_fp8=keep_fp8,
                in_place=in_place,
            )
            graphs.layout_built_for = built_for
            graphs.expert_rows = graphs.combine = None
        if in_place:
            if graphs.received_rows is None:
                with torch.inference_mode(False):  # normal views: later forwards may run under plain no_grad
                    graphs.received_rows = received_rows(recv_SB, fmt)
            fixed = graphs.layout()
            return Received(fixed, *graphs.received_rows, fixed.layout.row_R)
        num_rows = s.num_slots * fmt.top_k
        if not s.fixed_expert_rows:
            rows = expert_rows(num_rows, fmt, keep_fp8, recv_SB.device)
        elif graphs.expert_rows is None:
            with torch.inference_mode(False):  # written by later forwards under plain no_grad too
                rows = graphs.expert_rows = expert_rows(num_rows, fmt, keep_fp8, recv_SB.device)
        else:
            rows = graphs.expert_rows
        table = graphs.layout.addresses
        assert table is not None
        out_RH, scales_RQ = rows
        fixed = graphs.layout(table.offset_of(out_RH), table.offset_of(out_RH if scales_RQ is None else scales_RQ))
        return Received(fixed, out_RH, scales_RQ)

    def launch_combine(self, expert_y_RH: torch.Tensor, r: Round, fixed: FixedLayout | KernelLayout) -> list:
        """The set's ``combine`` graph (``pieces.combine_graph``), reading the experts' output where it
        lies and the ``layout`` graph's tensors (``fixed`` is those)."""
        graphs, bufs, fmt = r.graphs, r.buffers, self.spec.fmt
        if graphs.combine is None:
            assert graphs.layout is not None  # the round's dispatch went through it
            graphs.combine = combine_graph(bufs, graphs.layout, fmt, capacity=self.spec.capacity)
        table = graphs.combine.addresses
        assert table is not None  # made with the combine graph
        y_RH = readable(expert_y_RH, fmt.dtype)  # held until the replay is queued
        graphs.combine(table.offset_of(y_RH))
        return [] if bufs.combine_barrier is not None else bufs.combine_exchange.start()

    def wait_combine(self, r: Round, out: torch.Tensor | None = None) -> torch.Tensor:
        """The set's ``combine_end`` graph (``pieces.combine_end_graph``): ``gather_sum`` of the
        returned rows into a y [T, H] made here, or ``out``."""
        graphs, bufs, fmt = r.graphs, r.buffers, self.spec.fmt
        assert graphs.staging is not None  # made by the round's dispatch
        if graphs.combine_end is None:
            graphs.combine_end = combine_end_graph(bufs, graphs.staging, fmt.dtype)
        table = graphs.combine_end.addresses
        assert table is not None
        direct = out is not None and out.data_ptr() % 16 == 0  # the graph writes 16-byte-aligned rows only
        y_TH = out if direct else None
        if y_TH is None:
            y_TH = torch.empty(r.num_tokens, fmt.hidden, dtype=fmt.dtype, device=bufs.combine_send_SH.device)
        graphs.combine_end(r.num_tokens, table.offset_of(y_TH))
        if out is not None and not direct:
            return out.copy_(y_TH)
        return y_TH
