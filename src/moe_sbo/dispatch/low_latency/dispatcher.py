"""``LowLatencyDispatcher``: DeepEP low-latency style. Fixed-capacity buffers, counts that never leave
the device, no host synchronisation: a whole MoE forward can be captured in a CUDA graph.

Legend: see ``moe_sbo/__init__.py``. Here T <= C (``max_tokens_per_rank``) and R = S * K expert rows
(fixed: every (slot, k) pair has one, real ones first).

This file keeps what every path shares: the options (one ``LowLatencyOptions``, ``options.py``), the
validation, the buffer sets per shape, the rounds, the handle, and the choice of path, made once per
shape from ``PATHS`` (the rule table; ``paths.py`` says what each path supports). The package holds
the rest: ``paths.py`` (the torch path, and what a path is), ``fused.py`` (the fused paths),
``wire.py`` (the packed row, fp8), ``transport.py`` (buffers, NCCL, symmetric memory or the copy
engines), ``reference.py`` (the torch path's index logic), ``kernels/`` (the fused Triton kernels),
``graphs.py``, ``pieces.py`` and ``addresses.py`` (the index graphs an eager forward replays). A
dispatch reads::

    dispatch_launch -> _launch_dispatch -> the shape's path's launch_dispatch:
                           TorchPath      reference.plan_send, one row copy
                           FusedPath      kernels.pack_rows_checked          (launched)
                           ReplayedPath   pieces.pack_graph's ``pack``       (replayed)
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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ...hooks import HookFn
from ...kernel_choice import HAS_TRITON, interpreting
from ...quant.fp8 import FP8_GROUP
from ...streams import capturing
from ..base import Dispatcher, EPGroup, register_dispatcher
from ..records import CombineInput, DispatchHandle, DispatchInput, DispatchOutput, Pending
from .graphs import PieceGraph, RoundGraphs, Staging
from .options import LowLatencyOptions, check_built_alike
from .paths import Path, PathSpec, Round, ShapeSets, TorchPath
from .reference import FixedLayout
from .transport import Buffers, RoundCounter, allocate_buffers, peers_reachable
from .wire import RowFormat, block_traffic

if HAS_TRITON:  # Triton comes with CUDA builds of torch; without it the torch path runs
    from .fused import FusedPath, ReplayedPath
    from .kernels import restamp_weights

    # The rule table: a shape runs the first path that supports it (``paths.py`` has the table).
    PATHS: tuple[type[Path], ...] = (ReplayedPath, FusedPath, TorchPath)
else:  # pragma: no cover - depends on the environment
    PATHS = (TorchPath,)
HAS_FUSED_KERNELS = HAS_TRITON  # whether Triton imports here (a fact of the process)

if TYPE_CHECKING:
    from .kernels import KernelLayout


@dataclass(frozen=True, kw_only=True)
class LowLatencyHandle(DispatchHandle):
    """Adds the dispatch's ``round`` (``paths.Round``: its path, buffers, graphs and ``slot_TP``, for
    summing the P returned rows) and the receiver's ``fixed`` layout: a ``reference.FixedLayout``
    on the torch path, a ``kernels.KernelLayout`` on the fused ones. Built each forward from what
    the launch already holds, so it copies nothing field by field."""

    round: Round
    fixed: FixedLayout | KernelLayout

    @property
    def slot_TP(self) -> torch.Tensor:
        return self.round.slot_TP


@register_dispatcher
class LowLatencyDispatcher(Dispatcher):
    """Fixed-capacity dispatch and combine, one fixed-size transfer each way.

    The keyword options are ``LowLatencyOptions``' (``options.py`` says what each does and refuses
    what cannot run together), kept checked as ``settings``: ``max_tokens_per_rank`` (C), ``fp8``,
    ``num_buffers``, ``kernels``, ``transport``, ``index_graphs``, ``fixed_expert_rows``, ``index_rows``.

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
        settings = LowLatencyOptions(
            max_tokens_per_rank, fp8, num_buffers, kernels, transport, index_graphs, fixed_expert_rows, index_rows
        )
        if settings.needs_triton() and not HAS_FUSED_KERNELS:
            raise ValueError(
                f"kernels={kernels!r} / transport={transport!r} need Triton, which does not import "
                "here; pip install triton, or use kernels='torch', transport='nccl'"
            )
        # The checked options, read from here alone (``self.options`` is the base's: the keywords as
        # ``make_dispatcher`` passed them, which ``MoELayer.sibling_dispatcher`` builds again from).
        self.settings = settings
        self.num_slots = ep.size * settings.max_tokens_per_rank  # S
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
        return self.settings.fp8

    @property
    def capacity(self) -> int | None:
        """C, the most tokens a rank may dispatch per forward (``max_tokens_per_rank``): callers that
        batch requests (``hf.generate``) refuse a larger batch on every rank before any collective."""
        return self.settings.max_tokens_per_rank

    def uses_triton(self, device: torch.device) -> bool:
        """Whether a forward on ``device`` runs the fused Triton kernels."""
        if self.settings.kernels == "torch" or not HAS_FUSED_KERNELS:
            return False
        return device.type == "cuda" or (self.settings.kernels == "triton" and interpreting())

    def transport_for(self, device: torch.device) -> str:
        """The transport a forward on ``device`` uses (``"auto"`` resolved; the same on every rank)."""
        if self.settings.transport != "auto":
            return self.settings.transport
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
        if ids_TK.is_cuda and self.settings.kernels != "torch" and HAS_FUSED_KERNELS:  # ``uses_triton`` on CUDA
            return  # the fused paths' pack kernel checks every id it reads and asserts on its flags
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

    # ---- buffers and the path, per shape ---------------------------------------------------------------

    def buffer_bytes(self, dtype: torch.dtype, hidden: int, top_k: int, device: torch.device | str = "cuda") -> int:
        """Bytes of this dispatcher's buffer sets for activations of ``dtype`` and shape ``hidden``,
        ``top_k`` on ``device`` (all ``num_buffers`` of them, staging included where the forward
        stages, and the ``layout`` graphs' expert rows with ``fixed_expert_rows``: the formula in the
        class docstring; the graphs' small index and address tensors not counted)."""
        o = self.settings
        row_bytes = RowFormat.make(hidden, top_k, dtype, o.fp8).row_bytes
        sets = (2 * self.num_slots + 1) * (row_bytes + hidden * dtype.itemsize)
        device = torch.device(device)
        if o.index_graphs and self.uses_triton(device):
            sets += Staging.bytes(o.max_tokens_per_rank, hidden, top_k, self.ep.size, dtype.itemsize)
            if o.fixed_expert_rows:  # the rows each set's layout graph gathers into
                keep_fp8 = self.deliver_fp8 and o.fp8
                row_out = hidden + hidden // FP8_GROUP * 4 if keep_fp8 else hidden * dtype.itemsize
                sets += self.num_slots * top_k * row_out
        return o.num_buffers * sets

    def buffers(self, device: torch.device, dtype: torch.dtype, hidden: int, top_k: int) -> list[Buffers]:
        """The buffer sets for this device, activation dtype and shape; allocated on first use only
        (with ``symm_mem``, a collective rendezvous: every rank's first forward reaches it together)."""
        return self.shape_sets(device, dtype, hidden, top_k).buffers

    def shape_sets(self, device: torch.device, dtype: torch.dtype, hidden: int, top_k: int) -> ShapeSets:
        """``ShapeSets`` of this device, activation dtype and shape (built, and the buffers allocated,
        on first use, as ``buffers``). The one place a path is chosen: the first of ``PATHS`` that
        supports the shape, and for a caller's capture the first that also runs inside one."""
        key = (device, dtype, hidden, top_k)
        sets = self._sets.get(key)
        if sets is None:
            o = self.settings
            fmt = RowFormat.make(hidden, top_k, dtype, o.fp8)
            fused = self.uses_triton(device)
            with torch.inference_mode(False):
                # Normal tensors even when first used under inference_mode: inference tensors could
                # not be written by a later forward under plain no_grad.
                transport = self.transport_for(device)
                if self._collective and self.ep.size > 1:
                    check_built_alike(o, self.num_experts, self.ep, device, dtype, hidden, top_k, transport)
                buffers = [
                    allocate_buffers(
                        device,
                        dtype,
                        fmt,
                        self.ep,
                        o.max_tokens_per_rank,
                        transport=transport,
                        collective=self._collective,
                        fused=fused,
                        destinations=HAS_FUSED_KERNELS,
                    )
                    for _ in range(o.num_buffers)
                ]
            spec = PathSpec(
                fmt=fmt,
                rank=self.ep.rank,
                num_ranks=self.ep.size,
                num_local_experts=self.num_local_experts,
                num_experts=self.num_experts,
                capacity=o.max_tokens_per_rank,
                in_place=self.rows_in_place(device),
                fixed_expert_rows=o.fixed_expert_rows,
            )
            supported = [p for p in PATHS if p.supports(fused, o.index_graphs)]
            path = supported[0](spec)
            capture_path = path if path.inside_capture else next(p for p in supported if p.inside_capture)(spec)
            traffic = block_traffic(fmt, o.max_tokens_per_rank, self.ep.size, self.ep.node_size)
            sets = self._sets[key] = ShapeSets(
                fmt=fmt,
                buffers=buffers,
                graphs=[RoundGraphs() for _ in range(o.num_buffers)],
                path=path,
                capture_path=capture_path,
                dispatch_traffic=traffic[0],
                combine_traffic=traffic[1],
            )
        return sets

    def rows_in_place(self, device: torch.device) -> bool:
        """Whether a dispatch on ``device`` leaves the received rows in place for the experts to read
        through the layout's index (``index_rows``, which the fused kernels' layout serves; fp8 rows
        only in rounds that deliver them as fp8)."""
        return self.settings.index_rows and self.uses_triton(device)

    def can_set_combine_weights(self, device: torch.device) -> bool:
        """Whether ``set_combine_weights`` runs on ``device``: the fused kernels wrote the dispatched
        rows where they were received (symmetric memory, or one rank without a collective), so a
        token's rank can rewrite their weights in place."""
        if not self.uses_triton(device):
            return False
        return not self._collective or self.transport_for(device) == "symm_mem"

    def set_combine_weights(self, handle: DispatchHandle, weights_TK: torch.Tensor) -> None:
        """The top-k weights combine applies for this round, given now instead of at dispatch (for
        callers that know them only at combine, as DeepEP's low-latency API): ``weights_TK`` float32
        [T, K] replace the ones each token's rows were dispatched with, on the experts' ranks.

        Collective over the EP group: every rank calls it for the round, after ``dispatch_wait`` and
        before ``combine_launch``. Needs ``can_set_combine_weights``. Sync: one kernel writing only
        the weights into the rows (the peers' receive buffers with symmetric memory), then, with
        symmetric memory, a barrier on the current stream; no host read, CUDA-graph safe."""
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(f"handle must be a low_latency dispatch's, got {type(handle).__name__}")
        r = handle.round
        device = r.buffers.dispatch_recv_SB.device
        if not self.can_set_combine_weights(device):
            raise ValueError(
                "set_combine_weights rewrites the dispatched rows where they were received, which needs the fused "
                f"kernels and symmetric memory (or one rank); here kernels={self.settings.kernels!r}, transport="
                f"{self.transport_for(device)!r}: pass the weights to dispatch instead"
            )
        shape = (r.num_tokens, r.sets.fmt.top_k)
        if tuple(weights_TK.shape) != shape or weights_TK.dtype != torch.float32 or weights_TK.device != device:
            raise ValueError(
                f"weights must be float32 {list(shape)} on {device}, got {weights_TK.dtype} {tuple(weights_TK.shape)} "
                f"on {weights_TK.device}"
            )
        self._check_round(r.generation)
        dst, barrier, fmt = r.buffers.dispatch_dst, r.buffers.dispatch_barrier, r.sets.fmt
        assert dst is not None, "buffers made where Triton imports have destinations"
        capacity = self.settings.max_tokens_per_rank

        def restamp(weights: torch.Tensor, slot_TP: torch.Tensor = r.slot_TP) -> None:
            restamp_weights(weights, slot_TP, fmt, dst, capacity)
            if barrier is not None:
                barrier.wait()  # every rank's new weights are in this rank's rows after it

        if r.path.inside_capture:  # launched each round (the fused kernels, or a caller's capture)
            restamp(weights_TK.contiguous())
            return
        # An eager round of the index graphs: the weights go to the set's staging and a piece per T
        # replays the kernel and the barrier (one launch each would cost the host far more).
        graphs = r.graphs
        if graphs.restamp_weights_CK is None:
            with torch.inference_mode(False):
                graphs.restamp_weights_CK = torch.empty(capacity, fmt.top_k, dtype=torch.float32, device=device)
        staged = graphs.restamp_weights_CK[: r.num_tokens]
        staged.copy_(weights_TK)
        piece = graphs.restamp.get(r.num_tokens)
        if piece is None:
            # The set's slot_TP is a view of its staging: the same tensor every round of this T.
            piece = graphs.restamp[r.num_tokens] = PieceGraph(
                lambda: restamp(staged), capture=device.type == "cuda", addresses=None
            )
        piece()

    def max_rounds_in_flight(self) -> int:
        return self.settings.num_buffers

    def transfer_sms(self, device: torch.device) -> int:
        """NCCL's CTAs over ``nccl``; 0 over ``symm_mem`` (its stores are part of the pack kernel, on the
        current stream, so nothing runs beside it) and ``copy_engine`` (the copy engines, no SMs)."""
        return super().transfer_sms(device) if self.transport_for(device) == "nccl" else 0

    def _check_round(self, generation: int) -> None:
        if self._rounds.launched - generation > self.settings.num_buffers:
            raise RuntimeError(
                f"this dispatch's buffers were taken by a later one: {self._rounds.launched - generation - 1} "
                f"dispatches started after it, but a low_latency dispatcher keeps num_buffers = "
                f"{self.settings.num_buffers} rounds in flight; combine each round before starting more, or "
                "raise num_buffers"
            )

    # ---- the four phases: the round's path runs each -------------------------------------------------

    def _launch_dispatch(self, inp: DispatchInput) -> Pending:
        x_TH, ids_TK = inp.x_TH, inp.topk_ids_TK
        device = x_TH.device
        sets = self._sets.get((device, x_TH.dtype, x_TH.shape[1], ids_TK.shape[1]))
        if sets is None:  # the shape's first forward: allocate its buffers, choose its path
            sets = self.shape_sets(device, x_TH.dtype, x_TH.shape[1], ids_TK.shape[1])
        path = sets.path
        if capturing(device):  # a caller's capture records the kernels directly, not through index graphs
            self._check_capturable_transport(device)
            path = sets.capture_path
        generation = self._rounds.launched
        self._rounds.launched += 1
        index = generation % self.settings.num_buffers  # the buffer set this round takes
        bufs, graphs = sets.buffers[index], sets.graphs[index]
        slot_TP, works = path.launch_dispatch(inp, bufs, graphs)
        state = Round(sets, path, slot_TP, bufs, graphs, generation, x_TH.shape[0])
        return Pending(works=works, state=state, traffic=sets.dispatch_traffic)

    def _wait_dispatch(self, pending: Pending) -> DispatchOutput:
        pending.wait()
        r: Round = pending.state
        self._check_round(r.generation)
        got, fmt = r.path.wait_dispatch(r, self.deliver_fp8), r.sets.fmt
        handle = LowLatencyHandle(
            num_tokens=r.num_tokens,
            hidden_size=fmt.hidden,
            dtype=fmt.dtype,
            layout=got.fixed.layout,
            traffic=r.sets.dispatch_traffic,
            round=r,
            fixed=got.fixed,
        )
        # Of the P x C x K fixed rows, a rank's experts get C x K on average: each of the P x C slots'
        # K choices is on this rank with probability L / E = 1 / P.
        expected_rows = self.settings.max_tokens_per_rank * fmt.top_k
        return self._output(got.expert_x_RH, handle, got.scales_RQ, expected_rows=expected_rows, rows_R=got.rows_R)

    def _check_combine_input(self, inp: CombineInput) -> None:
        """A round whose layout was rewritten to read packed rows (``packed.pack_rows``) takes the
        experts' outputs in that layout: [L * N, H]; any other, one row per grouped row."""
        packed_rows = getattr(getattr(inp.handle, "round", None), "packed_rows", None)
        if packed_rows is None:
            super()._check_combine_input(inp)
        elif tuple(inp.expert_y_RH.shape) != (packed_rows, inp.handle.hidden_size):
            raise ValueError(
                f"expert_y must be the packed layout's [L * N, H] = {(packed_rows, inp.handle.hidden_size)} (this "
                f"round's rows were packed), got {tuple(inp.expert_y_RH.shape)}"
            )

    def _launch_combine(self, inp: CombineInput) -> Pending:
        handle: LowLatencyHandle = inp.handle  # type: ignore[assignment]
        r = handle.round
        self._check_round(r.generation)
        # The dispatch's path, unless a caller's capture is recording this combine (as at launch).
        path = r.sets.capture_path if capturing(r.buffers.combine_send_SH.device) else r.path
        works = path.launch_combine(inp.expert_y_RH, r, handle.fixed)
        return Pending(works=works, state=path, traffic=r.sets.combine_traffic)

    def _wait_combine(self, pending: Pending) -> torch.Tensor:
        return self._wait_combine_into(pending, None)

    def _wait_combine_into(self, pending: Pending, out_TH: torch.Tensor | None) -> torch.Tensor:
        pending.wait()
        handle: LowLatencyHandle = pending.handle  # type: ignore[assignment]
        self._check_round(handle.round.generation)
        path: Path = pending.state  # the path that launched this combine
        return path.wait_combine(handle.round, out_TH)


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
