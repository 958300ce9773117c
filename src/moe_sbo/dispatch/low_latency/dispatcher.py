"""``LowLatencyDispatcher``: DeepEP low-latency style. Fixed-capacity buffers, counts that never leave
the device, no host synchronisation: a whole MoE forward can be captured in a CUDA graph.

Legend: see ``moe_sbo/__init__.py``. Here T <= C (``max_tokens_per_rank``) and R = S * K expert rows
(fixed: every (slot, k) pair has one, real ones first).

This file orchestrates: it chooses a path per forward and runs the four phases. The package holds the
rest: ``options.py`` (the constructor options and their checks), ``wire.py`` (the packed row, fp8),
``transport.py`` (buffers, NCCL, symmetric memory or the copy engines), ``reference.py`` (the torch
path's index logic), ``kernels/`` (the fused Triton path), ``graphs.py``, ``pieces.py`` and
``addresses.py`` (the index graphs an eager forward replays). A dispatch reads::

    dispatch_launch -> _launch_dispatch -> kernels.pack_rows_checked     (direct)
                                        -> pieces.pack_graph's ``pack``  (replayed)
                    -> Exchange.start (transport.py): the all-to-all, or nothing more (symm_mem)

The wire format (the blocks each phase moves) is ``wire.py``'s.

The hard part is the receiver's layout. Grouped GEMM needs rows grouped by expert, but the number
of rows per expert is data: a fixed R = S * K rows are laid out expert-major with the real rows
first and the per-expert counts on the device; ``torch._grouped_mm`` (offsets = cumsum(counts))
computes only rows below the last offset, so the padding tail costs a gather but no GEMM work.
The alternative, a padded ``[L, S, H]`` layout with counts = S per expert, would make the GEMM run
on L * S rows (L times the real work at decode, all of it padding); we take the gather instead. The
padding rows' expert outputs are undefined (grouped GEMM leaves them unwritten), so combine masks
them rather than multiplying by a zero weight (0 * NaN is NaN). On the torch path the receiver's
gather and combine's reduction still touch all R rows, about P times the real ones under balanced
routing; the fused kernels (``kernels/``, the CUDA default) read the device count and skip them.

Ids may be -1: "no expert" (a padding token; ``mask_padding_tokens`` makes a capacity-sized input
whose real count is a device tensor). Other out-of-range ids are checked without a host read: a
device-side assert on CUDA (loud and fatal, never a silent drop), a plain check on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from ...hooks import HookFn
from ...quant.fp8 import FP8_GROUP
from ...streams import capturing
from ..base import (
    CombineInput,
    Dispatcher,
    DispatchHandle,
    DispatchInput,
    DispatchOutput,
    EPGroup,
    Pending,
    Traffic,
    register_dispatcher,
)
from ..reduce import gather_sum, interpreting_triton
from .addresses import readable
from .graphs import RoundGraphs, Staging
from .options import LowLatencyOptions, check_built_alike
from .reference import FixedLayout, group_slots_by_expert, plan_send, reduce_pairs
from .transport import Buffers, RoundCounter, allocate_buffers, peers_reachable
from .wire import RowFormat

try:  # Triton comes with CUDA builds of torch; without it the torch reference path runs
    from . import kernels, pieces
except ImportError:  # pragma: no cover - depends on the environment
    kernels = None  # type: ignore[assignment]
    pieces = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .kernels import KernelLayout

HAS_FUSED_KERNELS = kernels is not None  # whether Triton imports here (a fact of the process)


@dataclass(frozen=True)
class ShapeSets:
    """The buffer sets of one (device, activation dtype, H, K), and what every forward of that shape
    would otherwise derive again: the row format, which path runs, the bytes each phase moves.

    Built on the shape's first forward (which allocates the buffers) and looked up once per phase
    after: an eager decode step's dispatch is host-bound, so what is fixed is not recomputed.
    ``graphs[i]`` are buffer set ``i``'s index graphs (``graphs.py``), built on first use."""

    fmt: RowFormat
    buffers: list[Buffers]
    graphs: list[RoundGraphs]
    fused: bool  # the fused Triton kernels run (``uses_triton``)
    index_graphs: bool  # eager forwards replay the index graphs (``index_graphs`` and fused)
    in_place: bool  # the received rows stay in place (``index_rows`` and fused)
    dispatch_traffic: Traffic
    combine_traffic: Traffic


@dataclass(slots=True)  # not frozen: built every forward, and a frozen init costs the host more
class _Round:
    """One dispatch round, as its launch fixed it: the shape's buffer sets, the buffer set it took
    and its ``generation`` (the round count at launch), the set's index graphs when the staged path
    runs, the sender's ``slot_TP`` (where each token's rows went) and T."""

    sets: ShapeSets
    slot_TP: torch.Tensor
    buffers: Buffers
    graphs: RoundGraphs | None  # the round's index graphs, when the staged path runs
    generation: int
    num_tokens: int


@dataclass(frozen=True, kw_only=True)
class LowLatencyHandle(DispatchHandle):
    """Adds the dispatch's ``round`` (its buffers, graphs and ``slot_TP``, for summing the P
    returned rows) and the receiver's ``fixed`` layout: a ``reference.FixedLayout`` on the torch
    path, a ``kernels.KernelLayout`` on the fused one. Built each forward from what the launch
    already holds, so it copies nothing field by field."""

    round: _Round
    fixed: FixedLayout | KernelLayout

    @property
    def slot_TP(self) -> torch.Tensor:
        return self.round.slot_TP


@register_dispatcher
class LowLatencyDispatcher(Dispatcher):
    """Fixed-capacity dispatch and combine, one fixed-size transfer each way.

    The keyword options are ``LowLatencyOptions``' (``options.py`` says what each does and refuses
    what cannot run together): ``max_tokens_per_rank`` (C), ``fp8``, ``num_buffers``, ``kernels``,
    ``transport``, ``index_graphs``, ``fixed_expert_rows``, ``index_rows``.

    Memory (``buffer_bytes``): each buffer set holds a dispatch send [S, B] and receive [S + 1, B]
    buffer and a combine send [S, H] and receive [S + 1, H] buffer (activation dtype), S = P * C, so
    ``num_buffers * (2S + 1) * (B + H * elem)`` bytes, allocated on the first forward, plus with
    ``index_graphs`` the staging of each set, ``num_buffers * C * (H * elem + 12K + 8P)`` bytes, and
    its graphs' index tensors (about ``num_buffers * 24 * S * K`` bytes); a forward then allocates
    its expert rows [S * K, H] twice (inputs and outputs of the experts; once with ``index_rows``);
    with ``fixed_expert_rows`` the inputs are kept per set instead, ``num_buffers * S * K * H * elem``
    bytes (e4m3 and its scales with ``deliver_fp8``). DeepSeek-V3 at EP2 with C = 4096, bf16: B = 14400, 2 sets of
    0.47 GB + 2 x 59 MB of staging = 1.06 GB per rank; with C = 128: 2 x 15 MB of buffers + 2 x 2 MB
    of staging, and 2 x 29 MB of fixed expert rows.

    Inference only: a forward with autograd enabled raises (wrap it in ``torch.inference_mode()``).

    Sync: no phase reads anything on the host, and every shape is fixed by C, so after one eager
    forward (which allocates the buffers) the whole forward is CUDA-graph capturable. Transfers run
    on the communicator's stream; ``*_wait`` makes the current stream wait for them (CUDA) or blocks
    the host (gloo). Without an initialised process group (one rank) the transfer is a local copy
    (or, with the fused kernels, no copy: they write the receive buffer directly).
    """

    name = "low_latency"
    graph_capturable = True  # a fact of the scheme (fixed shapes, no host read), not a knob

    def __init__(
        self,
        num_experts: int,
        ep: EPGroup,
        *,
        max_tokens_per_rank: int = 128,
        fp8: bool = False,
        num_buffers: int = 2,
        kernels: str = "auto",
        transport: str = "auto",
        index_graphs: bool = True,
        fixed_expert_rows: bool = False,
        index_rows: bool = False,
    ):
        super().__init__(num_experts, ep)
        options = LowLatencyOptions(
            max_tokens_per_rank, fp8, num_buffers, kernels, transport, index_graphs, fixed_expert_rows, index_rows
        )
        if options.needs_triton() and not HAS_FUSED_KERNELS:
            raise ValueError(
                f"kernels={kernels!r} / transport={transport!r} need Triton, which does not import "
                "here; pip install triton, or use kernels='torch', transport='nccl'"
            )
        self.settings = options  # the checked options (``self.options``: the keywords make_dispatcher passed)
        # The options as attributes, read on every forward.
        self.capacity = options.max_tokens_per_rank
        self.fp8 = options.fp8
        self.num_buffers = options.num_buffers
        self.kernels = options.kernels
        self._fused_kernels = options.kernels != "torch" and HAS_FUSED_KERNELS  # wherever they can run
        self.transport = options.transport
        self.index_graphs = options.index_graphs
        self.fixed_expert_rows = options.fixed_expert_rows
        self.index_rows = options.index_rows
        self.num_slots = ep.size * self.capacity
        # One rank uses the real communicator when there is one (a graph then captures what it would
        # at EP > 1); without a process group, or with a one-rank EP group inside a larger job, it
        # copies locally.
        self._collective = ep.size > 1 or (dist.is_initialized() and dist.get_world_size(ep.group) == 1)
        self._sets: dict[tuple, ShapeSets] = {}  # by (device, dtype, H, K)
        # Shared with twin() dispatchers (two-batch overlap): they take turns on the same buffer sets.
        self._rounds = RoundCounter()

    # ---- validation (before any collective, no host read of device data) -----------------------------

    @property
    def sends_fp8(self) -> bool:
        return self.fp8

    def uses_triton(self, device: torch.device) -> bool:
        """Whether a forward on ``device`` runs the fused Triton kernels."""
        if not self._fused_kernels:
            return False
        return device.type == "cuda" or (self.kernels == "triton" and interpreting_triton())

    def transport_for(self, device: torch.device) -> str:
        """The transport a forward on ``device`` uses (``"auto"`` resolved; the same on every rank)."""
        if self.transport != "auto":
            return self.transport
        usable = device.type == "cuda" and self.uses_triton(device) and self._collective and self.ep.size > 1
        return "symm_mem" if usable and peers_reachable(self.ep.size) else "nccl"

    def _check_capturable_transport(self, device: torch.device) -> None:
        """Inside a CUDA-graph capture, before any collective: the ``nccl`` transport runs the group's
        all-to-all, which a graph records only over NCCL, not a shared GPU's gloo group (``launch``)."""
        if self.transport_for(device) == "nccl" and self._collective and self.ep.size > 1:
            backend = dist.get_backend(self.ep.group)
            if backend != "nccl":
                raise ValueError(
                    f"low_latency's transport 'nccl' runs the process group's all-to-all, and this group is "
                    f"{backend} (ranks sharing a GPU), which a CUDA graph cannot capture; use "
                    "transport='symm_mem' (or 'auto', which picks it there) to capture, or run eagerly"
                )

    def _check_dispatch_input(self, inp: DispatchInput) -> None:
        super()._check_dispatch_input(inp)
        if torch.is_grad_enabled():
            raise RuntimeError(
                "low_latency is inference-only (rows travel as packed bytes through reused buffers, which "
                "carry no autograd graph); run the forward under torch.inference_mode() or torch.no_grad()"
            )
        device = inp.x_TH.device
        fused = self.uses_triton(device)
        self.settings.check_input(inp.x_TH, fused, self.transport_for(device), self._collective)

    def _check_topk_ids(self, ids_TK: torch.Tensor) -> None:
        """Ids in ``[-1, E)``, -1 meaning "no expert". Never a host read of device data: on CUDA a
        device-side assert (a bad id aborts at the next synchronising call: loud, never a silent
        drop); on CPU there is no device, so a plain check raises ``ValueError`` here."""
        if ids_TK.is_cuda and self._fused_kernels:  # ``uses_triton`` on CUDA, without a device object
            return  # the pack kernel checks every id it reads; _launch_dispatch asserts on its flags
        if not ids_TK.numel():
            return
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

    def buffer_bytes(self, dtype: torch.dtype, hidden: int, top_k: int, device: torch.device | str = "cuda") -> int:
        """Bytes of this dispatcher's buffer sets for activations of ``dtype`` and shape ``hidden``,
        ``top_k`` on ``device`` (all ``num_buffers`` of them, staging included where the forward
        stages, and the ``layout`` graphs' expert rows with ``fixed_expert_rows``: the formula in the
        class docstring; the graphs' small index and address tensors not counted)."""
        row_bytes = RowFormat.make(hidden, top_k, dtype, self.fp8).row_bytes
        sets = (2 * self.num_slots + 1) * (row_bytes + hidden * dtype.itemsize)
        device = torch.device(device)
        if self.index_graphs and self.uses_triton(device):
            sets += Staging.bytes(self.capacity, hidden, top_k, self.ep.size, dtype.itemsize)
            if self.fixed_expert_rows:  # the rows each set's layout graph gathers into
                keep_fp8 = self.deliver_fp8 and self.fp8
                row_out = hidden + hidden // FP8_GROUP * 4 if keep_fp8 else hidden * dtype.itemsize
                sets += self.num_slots * top_k * row_out
        return self.num_buffers * sets

    def buffers(self, device: torch.device, dtype: torch.dtype, hidden: int, top_k: int) -> list[Buffers]:
        """The buffer sets for this device, activation dtype and shape; allocated on first use only
        (with ``symm_mem``, a collective rendezvous: every rank's first forward reaches it together)."""
        return self.shape_sets(device, dtype, hidden, top_k).buffers

    def shape_sets(self, device: torch.device, dtype: torch.dtype, hidden: int, top_k: int) -> ShapeSets:
        """``ShapeSets`` of this device, activation dtype and shape (built, and the buffers allocated,
        on first use, as ``buffers``)."""
        key = (device, dtype, hidden, top_k)
        sets = self._sets.get(key)
        if sets is None:
            fmt = RowFormat.make(hidden, top_k, dtype, self.fp8)
            fused = self.uses_triton(device)
            with torch.inference_mode(False):
                # Normal tensors even when first used under inference_mode: inference tensors could
                # not be written by a later forward under plain no_grad.
                transport = self.transport_for(device)
                if self._collective and self.ep.size > 1:
                    check_built_alike(self.settings, self.num_experts, self.ep, device, dtype, hidden, top_k, transport)
                buffers = [
                    allocate_buffers(
                        device,
                        dtype,
                        fmt,
                        self.ep,
                        self.capacity,
                        transport=transport,
                        collective=self._collective,
                        fused=fused,
                        destinations=HAS_FUSED_KERNELS,
                    )
                    for _ in range(self.num_buffers)
                ]
            # Fixed-size blocks, one to each other rank whatever the routing (as on the wire).
            per_rank = self.capacity * fmt.row_bytes, self.capacity * hidden * dtype.itemsize
            dispatch_bytes, combine_bytes = ((self.ep.size - 1) * b for b in per_rank)
            other_nodes = self.ep.size - self.ep.node_size
            sets = self._sets[key] = ShapeSets(
                fmt=fmt,
                buffers=buffers,
                graphs=[RoundGraphs() for _ in range(self.num_buffers)],
                fused=fused,
                index_graphs=self.index_graphs and fused,
                in_place=self.rows_in_place(device),
                dispatch_traffic=Traffic(
                    dispatch_bytes_sent=dispatch_bytes,
                    dispatch_bytes_recv=dispatch_bytes,
                    dispatch_inter_node_sent=other_nodes * per_rank[0],
                ),
                combine_traffic=Traffic(
                    combine_bytes_sent=combine_bytes,
                    combine_bytes_recv=combine_bytes,
                    combine_inter_node_sent=other_nodes * per_rank[1],
                ),
            )
        return sets

    def rows_in_place(self, device: torch.device) -> bool:
        """Whether a dispatch on ``device`` leaves the received rows in place for the experts to read
        through the layout's index (``index_rows``, which the fused kernels' layout serves)."""
        return self.index_rows and self.uses_triton(device)

    def max_rounds_in_flight(self) -> int:
        return self.num_buffers

    def transfer_sms(self, device: torch.device) -> int:
        """NCCL's CTAs over ``nccl``; 0 over ``symm_mem`` (its stores are part of the pack kernel, on the
        current stream, so nothing runs beside it) and ``copy_engine`` (the copy engines, no SMs)."""
        return super().transfer_sms(device) if self.transport_for(device) == "nccl" else 0

    def _check_round(self, generation: int) -> None:
        if self._rounds.launched - generation > self.num_buffers:
            raise RuntimeError(
                f"this dispatch's buffers were taken by a later one: {self._rounds.launched - generation - 1} "
                f"dispatches started after it, but a low_latency dispatcher keeps num_buffers = "
                f"{self.num_buffers} rounds in flight; combine each round before starting more, or raise "
                "num_buffers"
            )

    # ---- the four phases -----------------------------------------------------------------------------

    def _launch_dispatch(self, inp: DispatchInput) -> Pending:
        x_TH, ids_TK = inp.x_TH, inp.topk_ids_TK
        num_tokens, hidden = x_TH.shape
        device = x_TH.device
        sets = self._sets.get((device, x_TH.dtype, hidden, ids_TK.shape[1]))
        if sets is None:  # the shape's first forward: allocate its buffers
            sets = self.shape_sets(device, x_TH.dtype, hidden, ids_TK.shape[1])
        if capturing(device):
            self._check_capturable_transport(device)
        generation = self._rounds.launched
        self._rounds.launched += 1
        bufs, fmt = sets.buffers[generation % self.num_buffers], sets.fmt
        # Under a caller's own capture the kernels are recorded directly, not through the index graphs.
        graphs = sets.graphs[generation % self.num_buffers] if sets.index_graphs and not capturing(device) else None
        if graphs is not None:
            slot_TP, works = self._pack_staged(graphs, inp, bufs, fmt)
        else:
            if sets.fused:
                assert bufs.dispatch_dst is not None, "buffers made where Triton imports have destinations"
                slot_TP = torch.empty(num_tokens, self.ep.size, dtype=torch.int64, device=device)
                kernels.pack_rows_checked(
                    x_TH.contiguous(),
                    ids_TK.contiguous(),
                    inp.topk_weights_TK.float().contiguous(),
                    bufs.dispatch_dst,
                    slot_TP,
                    fmt,
                    self.num_local_experts,
                    self.capacity,
                    self.num_experts,
                    kernels.two_pass(self.capacity),
                )
            else:
                plan = plan_send(ids_TK, self.num_local_experts, self.ep.size, self.capacity)
                rows_TB = fmt.pack(x_TH, ids_TK, inp.topk_weights_TK)
                torch.index_select(rows_TB, 0, plan.token_S, out=bufs.dispatch_send_SB)
                slot_TP = plan.slot_TP
            works = bufs.dispatch_exchange.start()
        state = _Round(sets, slot_TP, bufs, graphs, generation, num_tokens)
        return Pending(works=works, state=state, traffic=sets.dispatch_traffic)

    def _pack_staged(
        self, graphs: RoundGraphs, inp: DispatchInput, bufs: Buffers, fmt: RowFormat
    ) -> tuple[torch.Tensor, list]:
        """The fused send plan through the round's ``pack`` graph (``pieces.pack_graph``), which
        stages the caller's tensors itself -> (``slot_TP``, a view of the round's ``slot_CP`` valid
        until the round's buffers are reused; the works to wait on).

        With symmetric memory the transfer's start (nothing for ``symm_mem``, the peer copies for
        ``copy_engine``) is captured in the ``pack`` graph and its end (the barrier) in the
        ``layout`` graph, so the works returned are none; an NCCL collective stays outside."""
        x_TH = inp.x_TH
        if graphs.staging is None:
            graphs.staging = Staging.allocate(
                self.capacity, fmt.hidden, fmt.top_k, self.ep.size, fmt.dtype, x_TH.device
            )
        st = graphs.staging
        if graphs.pack is None:
            graphs.pack = pieces.pack_graph(
                bufs,
                st,
                fmt,
                num_local_experts=self.num_local_experts,
                num_experts=self.num_experts,
                capacity=self.capacity,
                two_pass=kernels.two_pass(self.capacity),
            )
        table = graphs.pack.addresses
        assert table is not None  # made with the pack graph
        values, read = st.pack_values(table, x_TH, inp.topk_ids_TK, inp.topk_weights_TK)  # read: held until queued
        graphs.pack(*values)
        works = [] if bufs.dispatch_barrier is not None else bufs.dispatch_exchange.start()
        return st.slot_TP(values[0]), works

    def _wait_dispatch(self, pending: Pending) -> DispatchOutput:
        pending.wait()
        s: _Round = pending.state
        self._check_round(s.generation)
        sets, fmt, recv_SB = s.sets, s.sets.fmt, s.buffers.dispatch_recv_SB
        fixed: FixedLayout | KernelLayout
        rows_R = None
        if sets.fused:
            if s.graphs is None:
                received_SB, two_pass = recv_SB[: self.num_slots], kernels.two_pass(self.capacity)
                fixed = kernels.expert_layout(received_SB, fmt, self.ep.rank, self.num_local_experts, two_pass)
                if sets.in_place:
                    expert_x_RH, scales_RQ = fmt.x(recv_SB), None
                else:
                    expert_x_RH, scales_RQ = kernels.gather_rows(recv_SB, fixed, fmt, keep_fp8=self.deliver_fp8)
            else:
                fixed, expert_x_RH, scales_RQ = self._layout_staged(s)
            if sets.in_place:
                # Every row's source: its slot, or the zero slot S for padding (the layout writes all R).
                rows_R = fixed.layout.row_R
        else:
            local_ids_SK = self._local_ids(fmt.ids(recv_SB[: self.num_slots]).long(), self.ep.rank)
            fixed = group_slots_by_expert(local_ids_SK, fmt.weights(recv_SB[: self.num_slots]), self.num_local_experts)
            # x of all S + 1 rows (the last is the zero padding slot), then one gather into expert order.
            if self.deliver_fp8 and fmt.fp8:
                q_SH, scales_SQ = fmt.x_fp8(recv_SB)
                expert_x_RH, scales_RQ = q_SH[fixed.layout.row_R], scales_SQ[fixed.layout.row_R]
            else:
                expert_x_RH, scales_RQ = fmt.x(recv_SB)[fixed.layout.row_R], None
        handle = LowLatencyHandle(
            num_tokens=s.num_tokens,
            hidden_size=fmt.hidden,
            dtype=fmt.dtype,
            layout=fixed.layout,
            traffic=sets.dispatch_traffic,
            round=s,
            fixed=fixed,
        )
        # Of the P x C x K fixed rows, a rank's experts get C x K on average: each of the P x C slots'
        # K choices is on this rank with probability L / E = 1 / P.
        expected_rows = self.capacity * fmt.top_k
        return self._output(expert_x_RH, handle, scales_RQ, expected_rows=expected_rows, rows_R=rows_R)

    def _layout_staged(self, s: _Round) -> tuple[KernelLayout, torch.Tensor, torch.Tensor | None]:
        """The round's ``layout`` graph (``pieces.layout_graph``) -> (the receiver's layout, the
        expert rows and their scales; with ``index_rows`` (``in_place``), the receive buffer's rows
        [S + 1, H] and None).

        The graph first ends a symmetric-memory transfer (the barrier) when ``pack`` started one,
        and (unless ``in_place``) gathers the rows into tensors made here for this forward, or with
        ``fixed_expert_rows`` into the set's own (valid until its next round, ``num_buffers``
        dispatches later, as the layout and the received rows are). Captured again if
        ``deliver_fp8`` or ``in_place`` changed since (and the set's ``combine`` graph with it: it
        reads the layout's tensors)."""
        graphs, keep_fp8, in_place, fmt = s.graphs, self.deliver_fp8, s.sets.in_place, s.sets.fmt
        assert graphs is not None  # the staged path
        recv_SB = s.buffers.dispatch_recv_SB
        built_for = (keep_fp8, in_place)
        if graphs.layout is None or graphs.layout_built_for != built_for:
            graphs.layout = pieces.layout_graph(
                s.buffers,
                fmt,
                rank=self.ep.rank,
                num_local_experts=self.num_local_experts,
                num_slots=self.num_slots,
                two_pass=kernels.two_pass(self.capacity),
                keep_fp8=keep_fp8,
                in_place=in_place,
            )
            graphs.layout_built_for = built_for
            graphs.expert_rows = graphs.combine = None
        if in_place:
            if graphs.received_rows is None:
                with torch.inference_mode(False):  # a normal view: later forwards may run under plain no_grad
                    graphs.received_rows = fmt.x(recv_SB)
            return graphs.layout(), graphs.received_rows, None
        num_rows = self.num_slots * fmt.top_k
        if not self.fixed_expert_rows:
            rows = kernels.expert_rows(num_rows, fmt, keep_fp8, recv_SB.device)
        elif graphs.expert_rows is None:
            with torch.inference_mode(False):  # written by later forwards under plain no_grad too
                rows = graphs.expert_rows = kernels.expert_rows(num_rows, fmt, keep_fp8, recv_SB.device)
        else:
            rows = graphs.expert_rows
        table = graphs.layout.addresses
        assert table is not None
        out_RH, scales_RQ = rows
        fixed = graphs.layout(table.offset_of(out_RH), table.offset_of(out_RH if scales_RQ is None else scales_RQ))
        return fixed, out_RH, scales_RQ

    def _launch_combine(self, inp: CombineInput) -> Pending:
        handle: LowLatencyHandle = inp.handle  # type: ignore[assignment]
        r = handle.round
        self._check_round(r.generation)
        bufs, fused = r.buffers, r.sets.fused
        staged = r.graphs is not None and not capturing(bufs.combine_send_SH.device)
        if staged:
            works = self._combine_staged(inp.expert_y_RH, handle)
        else:
            if fused:
                assert bufs.combine_dst is not None, "buffers made where Triton imports have destinations"
                kernels.reduce_pairs(
                    inp.expert_y_RH.to(handle.dtype).contiguous(),  # the blocks hold the activation dtype
                    cast("KernelLayout", handle.fixed),
                    bufs.dispatch_recv_SB,
                    r.sets.fmt,
                    bufs.combine_dst,
                    self.capacity,
                )
            else:
                bufs.combine_send_SH.copy_(reduce_pairs(inp.expert_y_RH, cast(FixedLayout, handle.fixed)))
            works = bufs.combine_exchange.start()
        return Pending(works=works, state=(fused, staged), traffic=r.sets.combine_traffic)

    def _combine_staged(self, expert_y_RH: torch.Tensor, handle: LowLatencyHandle) -> list:
        """``reduce_pairs`` (and with symmetric memory the transfer's start) from the set's
        ``combine`` graph (``pieces.combine_graph``), reading the experts' output where it lies ->
        the works to wait on (an NCCL collective, called after the replay; none with symmetric
        memory, whose barrier ends the ``combine_end`` graph)."""
        graphs, bufs, fmt = handle.round.graphs, handle.round.buffers, handle.round.sets.fmt
        assert graphs is not None
        if graphs.combine is None:
            assert graphs.layout is not None  # the round's dispatch went through it
            graphs.combine = pieces.combine_graph(bufs, graphs.layout, fmt, capacity=self.capacity)
        table = graphs.combine.addresses
        assert table is not None  # made with the combine graph
        y_RH = readable(expert_y_RH, fmt.dtype)  # held until the replay is queued
        graphs.combine(table.offset_of(y_RH))
        return [] if bufs.combine_barrier is not None else bufs.combine_exchange.start()

    def _wait_combine(self, pending: Pending) -> torch.Tensor:
        pending.wait()
        handle: LowLatencyHandle = pending.handle  # type: ignore[assignment]
        self._check_round(handle.round.generation)
        fused, staged = pending.state
        if staged:
            return self._sum_staged(handle)
        # Each token's P returned rows (slot S where it sent nothing), summed in float32 in a fixed order.
        return gather_sum(
            handle.round.buffers.combine_slots_SH,
            handle.round.slot_TP,
            out_dtype=handle.dtype,
            kernels="triton" if fused else "torch",
        )

    def _sum_staged(self, handle: LowLatencyHandle) -> torch.Tensor:
        """``gather_sum`` of the returned rows from the set's ``combine_end`` graph
        (``pieces.combine_end_graph``; with symmetric memory after the transfer's end, the barrier),
        into a y [T, H] made here."""
        graphs, bufs = handle.round.graphs, handle.round.buffers
        assert graphs is not None and graphs.staging is not None
        if graphs.combine_end is None:
            graphs.combine_end = pieces.combine_end_graph(bufs, graphs.staging, handle.dtype)
        table = graphs.combine_end.addresses
        assert table is not None
        y_TH = torch.empty(
            handle.num_tokens, handle.hidden_size, dtype=handle.dtype, device=bufs.combine_send_SH.device
        )
        graphs.combine_end(handle.num_tokens, table.offset_of(y_TH))
        return y_TH


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
