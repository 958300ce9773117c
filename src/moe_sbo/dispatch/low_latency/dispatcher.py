"""``low_latency``: DeepEP low-latency style. Fixed-capacity buffers, counts that never leave the
device, no host synchronisation: a whole MoE forward can be captured in a CUDA graph.

Legend: see ``moe_sbo/__init__.py``. Here T <= C (``max_tokens_per_rank``) and R = S * K expert rows
(fixed: every (slot, k) pair has one, real ones first).

Files: ``ll_wire.py`` (the packed row, fp8), ``ll_reference.py`` (the torch path's index logic),
``ll_kernels.py`` (the fused Triton path), ``ll_transport.py`` (buffers, NCCL or symmetric memory);
this one chooses between them and runs the four phases.

Wire format: one fixed-size block per (rank, peer) and phase, moved by one ``all_to_all_single``
(``transport="nccl"``) or written by the packing kernel straight into the peer's symmetric-memory
receive buffer (``"symm_mem"``, the CUDA default from two GPUs)::

    dispatch  send [P, C, B] uint8. Block p holds, in its first rows, each token with at least one
              expert on rank p, once (rank-deduplicated), in token order; the rest of the block is
              the padding row (x zero, ids -1). A row packs x (activation dtype, or fp8 e4m3 plus
              Q float32 scales), the K global expert ids (int32) and the K weights (float32).
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..hooks import HookFn
from ..quant.fp8 import FP8_GROUP
from ..streams import capturing
from .base import (
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
from .ll_addresses import CallerAddresses, readable, stage_inputs
from .ll_graphs import PieceGraph, RoundGraphs, Staging
from .ll_reference import group_slots_by_expert, plan_send, reduce_pairs
from .ll_transport import (
    Buffers,
    RoundCounter,
    allocate_buffers,
    ll_bulk,
    ll_kernels,
    peers_reachable,
    start_exchange,
)
from .ll_wire import RowFormat
from .reduce import gather_sum, interpreting_triton


@dataclass(frozen=True)
class ShapeSets:
    """The buffer sets of one (device, activation dtype, H, K), and what every forward of that shape
    would otherwise derive again: the row format, which path runs, the bytes each phase moves.

    Built on the shape's first forward (which allocates the buffers) and looked up once per phase
    after: an eager decode step's dispatch is host-bound, so what is fixed is not recomputed.
    ``graphs[i]`` are buffer set ``i``'s index graphs (``ll_graphs.py``), built on first use."""

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
    returned rows) and the receiver's ``fixed`` layout. Built each forward from what the launch
    already holds, so it copies nothing field by field."""

    round: _Round
    fixed: Any  # FixedLayout (torch path) or ll_kernels.KernelLayout (fused kernels)

    @property
    def slot_TP(self) -> torch.Tensor:
        return self.round.slot_TP


KERNELS = ("auto", "triton", "torch")
# From this capacity (tokens per rank) the send plan and the receiver layout run as two passes
# (``ll_bulk``: work linear in the tokens) instead of one (``ll_kernels``: quadratic, fewer launches).
BULK_MIN_CAPACITY = 512
TRANSPORTS = ("auto", "nccl", "symm_mem", "copy_engine")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@register_dispatcher
class LowLatencyDispatcher(Dispatcher):
    """Fixed-capacity dispatch and combine, one fixed-size transfer each way.

    ``max_tokens_per_rank`` (C): the most tokens any rank may pass to one dispatch; more raise
    ``ValueError`` before any collective. ``fp8``: send x as e4m3 with a float32 scale per token and
    128 values (H must be a multiple of 128), dequantised on arrival (or handed to FP8 experts as
    they arrived: ``deliver_fp8``, set by ``MoELayer(expert_dtype="fp8")``); combine stays in the activation
    dtype. ``num_buffers``: buffer sets used in turn, so that many rounds may be in flight at once
    (2, as DeepEP: one per micro-batch of two-batch overlap); a round whose buffers a later round
    took raises instead of reading them.

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

    ``kernels``: ``"triton"`` runs the five fused kernels (``ll_kernels`` and ``reduce.gather_sum``;
    CUDA, or CPU under ``TRITON_INTERPRET=1``); ``"torch"`` the reference chain of torch ops (any
    device); ``"auto"`` Triton on CUDA when it imports, torch otherwise. Both produce the same bytes on the wire and
    the same layout; combine sums in float32 either way (the order differs, so bf16 results may
    differ by an ulp between the two, never run to run).

    ``transport``: ``"nccl"`` a fixed-size ``all_to_all_single`` per phase (portable, capturable;
    gloo on CPU); ``"symm_mem"`` PyTorch symmetric memory: the fused kernels write each block
    straight into the peer's receive buffer over NVLink and the phase ends with a symmetric-memory
    barrier (CUDA and ``kernels="triton"`` only; buffers are rendezvoused on the first forward);
    ``"copy_engine"``: the kernels fill a local send buffer, then one peer copy per block
    (``cudaMemcpyAsync`` into the peer's symmetric receive buffer: the GPU's copy engines move the
    bytes, no SMs, so compute on other streams keeps every SM) and a barrier (CUDA, either kernels);
    ``"auto"`` (default) ``symm_mem`` where it can run (CUDA, fused kernels, EP > 1 within one node
    whose GPUs reach each other: the faster one on 2x H200, docs/BENCHMARKS.md), ``nccl`` elsewhere.

    ``index_graphs`` (default True, fused kernels only): every kernel of both phases (about ten
    launches for the send plan, as many for the receiver layout, then the gather, the combine's
    reduction and its final sum) runs from four CUDA graphs per buffer set, captured on the set's
    first eager forward and replayed after; the caller's tensors (x, ids, weights, the expert rows,
    the experts' output, y) are read and written where they lie, through address tables the host
    writes before each replay (``ll_addresses.py``), so an eager phase costs the host one or two
    replays at any T (``ll_graphs.py``). Under a caller's own graph capture the kernels run
    directly; on CPU the same pieces run without capture. False: launch the kernels on every forward.

    ``fixed_expert_rows`` (default False; with ``index_graphs``): the ``layout`` graph gathers the
    expert rows into a buffer kept per set, as DeepEP's low-latency receive buffers, instead of rows
    allocated per forward: the rows handed out (``expert_x_RH`` and its scales) are then valid until
    the set's next round, ``num_buffers`` dispatches later, as the layout's counts already are, for
    the memory above, per layer.

    ``index_rows`` (default False; fused kernels, activation-dtype rows): leave the received rows
    where the transfer put them instead of copying every (token, local expert) row into expert
    order: the dispatch hands out the receive buffer's rows and the layout's index
    (``DispatchOutput.expert_rows_R``), and the experts' tiled GEMM reads its rows through it
    (other kernels gather them first). Refused with ``fp8`` or ``kernels="torch"``, which copy the
    rows; with ``kernels="auto"`` where the torch path runs (no Triton), the rows are copied as there.

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
        for option, value in (("max_tokens_per_rank", max_tokens_per_rank), ("num_buffers", num_buffers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} must be an int >= 1, got {value!r}")
        flags = (("index_graphs", index_graphs), ("fixed_expert_rows", fixed_expert_rows), ("index_rows", index_rows))
        for option, flag in flags:
            if not isinstance(flag, bool):
                raise ValueError(f"{option} must be True or False, got {flag!r}")
        if fixed_expert_rows and not index_graphs:
            raise ValueError(
                "fixed_expert_rows gathers the expert rows inside the index graphs; use it with index_graphs=True"
            )
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if (kernels == "triton" or transport == "symm_mem") and ll_kernels is None:
            raise ValueError(
                f"kernels={kernels!r} / transport={transport!r} need Triton, which does not import "
                "here; pip install triton, or use kernels='torch', transport='nccl'"
            )
        if index_rows and (kernels == "torch" or fp8):
            raise ValueError(
                "index_rows leaves the received activation-dtype rows in place for the fused kernels' "
                f"layout, but kernels={kernels!r} / fp8={bool(fp8)} copies them (the torch path gathers, fp8 rows "
                "are dequantised); use kernels='triton' or 'auto' and fp8=False with it, or leave index_rows off"
            )
        if transport == "symm_mem" and kernels == "torch":
            raise ValueError(
                "transport='symm_mem' writes into the peers' buffers from the fused Triton kernels; "
                "use kernels='triton' or 'auto' with it, or transport='nccl' with kernels='torch'"
            )
        self.capacity = max_tokens_per_rank
        self.fp8 = bool(fp8)
        self.num_buffers = num_buffers
        self.kernels = kernels
        self._fused_kernels = kernels != "torch" and ll_kernels is not None  # wherever they can run
        self.transport = transport
        self.index_graphs = index_graphs
        self.fixed_expert_rows = fixed_expert_rows
        self.index_rows = index_rows
        self.num_slots = ep.size * max_tokens_per_rank
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
        transport = self.transport_for(device)
        if transport in ("symm_mem", "copy_engine") and (device.type != "cuda" or not self._collective):
            raise ValueError(
                f"transport={transport!r} needs CUDA tensors and an initialised NCCL process group (it writes "
                f"into the peers' GPU buffers), got x on {device}"
                f"{'' if self._collective else ' without a process group'}; use transport='nccl'"
            )

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
            with torch.inference_mode(False):
                # Normal tensors even when first used under inference_mode: inference tensors could
                # not be written by a later forward under plain no_grad.
                transport = self.transport_for(device)
                self._check_built_alike(device, dtype, hidden, top_k, transport)
                buffers = [
                    allocate_buffers(
                        device, dtype, fmt, self.ep, self.capacity, transport=transport, collective=self._collective
                    )
                    for _ in range(self.num_buffers)
                ]
            fused = self.uses_triton(device)
            dispatch_bytes = (self.ep.size - 1) * self.capacity * fmt.row_bytes
            combine_bytes = (self.ep.size - 1) * self.capacity * hidden * dtype.itemsize
            sets = self._sets[key] = ShapeSets(
                fmt=fmt,
                buffers=buffers,
                graphs=[RoundGraphs() for _ in range(self.num_buffers)],
                fused=fused,
                index_graphs=self.index_graphs and fused,
                in_place=self.rows_in_place(device),
                dispatch_traffic=Traffic(dispatch_bytes_sent=dispatch_bytes, dispatch_bytes_recv=dispatch_bytes),
                combine_traffic=Traffic(combine_bytes_sent=combine_bytes, combine_bytes_recv=combine_bytes),
            )
        return sets

    def rows_in_place(self, device: torch.device) -> bool:
        """Whether a dispatch on ``device`` leaves the received rows in place for the experts to read
        through the layout's index (``index_rows``, which the fused kernels' layout serves)."""
        return self.index_rows and self.uses_triton(device)

    def _check_built_alike(self, device: torch.device, dtype: torch.dtype, hidden: int, top_k: int, transport: str):
        """Every rank's buffers must have the same layout: a rank with another capacity would send
        blocks of another size (gloo aborts the process, NCCL hangs, symmetric-memory stores land
        in the wrong rows). Compared once, before the first transfer, with one fixed-size all-gather;
        a difference raises the same ``ValueError`` on every rank."""
        if not self._collective or self.ep.size == 1:
            return
        setup = {
            "max_tokens_per_rank": self.capacity,
            "num_buffers": self.num_buffers,
            "fp8": int(self.fp8),
            "num_experts": self.num_experts,
            "hidden size": hidden,
            "top-k": top_k,
            "activation dtype": _DTYPE_CODES.get(dtype, -1),
            "transport": TRANSPORTS.index(transport),
        }
        mine = torch.tensor(list(setup.values()), dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.ep.size)]
        dist.all_gather(gathered, mine, group=self.ep.group)
        per_rank = torch.stack(gathered).cpu().tolist()
        names = {
            "activation dtype": {c: str(d) for d, c in _DTYPE_CODES.items()},
            "transport": dict(enumerate(TRANSPORTS)),
        }
        differing = [
            f"{name} {[names.get(name, {}).get(row[j], row[j]) for row in per_rank]}"
            for j, name in enumerate(setup)
            if any(row[j] != per_rank[0][j] for row in per_rank)
        ]
        if differing:
            raise ValueError(
                f"low_latency dispatchers must be built alike on every rank of the EP group, got per rank: "
                f"{'; '.join(differing)}; build every rank's layer with the same dispatcher_options, and give "
                "every rank inputs of the same dtype and hidden size"
            )

    def max_rounds_in_flight(self) -> int:
        return self.num_buffers

    def transfer_sms(self, device: torch.device) -> int:
        """NCCL's CTAs over ``nccl``; 0 over ``symm_mem`` (its stores are part of the pack kernel, on the
        current stream, so nothing runs beside it) and ``copy_engine`` (the copy engines, no SMs)."""
        return super().transfer_sms(device) if self.transport_for(device) == "nccl" else 0

    def _index_kernels(self):
        """The fused kernels that plan sends and lay out received rows: two passes from
        ``BULK_MIN_CAPACITY`` tokens per rank (``ll_bulk``), one pass below (``ll_kernels``)."""
        return ll_bulk if self.capacity >= BULK_MIN_CAPACITY else ll_kernels

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
        generation = self._rounds.launched
        self._rounds.launched += 1
        bufs, fmt = sets.buffers[generation % self.num_buffers], sets.fmt
        # Under a caller's own capture the kernels are recorded directly, not through the index graphs.
        graphs = sets.graphs[generation % self.num_buffers] if sets.index_graphs and not capturing(device) else None
        if graphs is not None:
            slot_TP, works = self._pack_staged(graphs, inp, bufs, fmt)
        else:
            if sets.fused:
                slot_TP = torch.empty(num_tokens, self.ep.size, dtype=torch.int64, device=device)
                self._pack(
                    x_TH.contiguous(), ids_TK.contiguous(), inp.topk_weights_TK.float().contiguous(), bufs, slot_TP, fmt
                )()
            else:
                plan = plan_send(ids_TK, self.num_local_experts, self.ep.size, self.capacity)
                rows_TB = fmt.pack(x_TH, ids_TK, inp.topk_weights_TK)
                torch.index_select(rows_TB, 0, plan.token_S, out=bufs.dispatch_send_SB)
                slot_TP = plan.slot_TP
            works = self._start_transfer(bufs, "dispatch", sets.fused)()
        state = _Round(sets, slot_TP, bufs, graphs, generation, num_tokens)
        return Pending(works=works, state=state, traffic=sets.dispatch_traffic)

    def _start_transfer(self, bufs: Buffers, phase: str, fused: bool) -> Callable[[], list]:
        """The start of the round's ``"dispatch"`` or ``"combine"`` transfer, as a call that holds no
        reference to ``self`` (the ``pack`` and ``combine`` graphs keep it)."""
        if phase == "dispatch":
            recv, send = bufs.dispatch_recv_SB[: self.num_slots], bufs.dispatch_send_SB
            barrier, peer_blocks = bufs.dispatch_barrier, bufs.dispatch_peer_blocks
        else:
            recv, send = bufs.combine_slots_SH, bufs.combine_send_SH
            barrier, peer_blocks = bufs.combine_barrier, bufs.combine_peer_blocks
        return functools.partial(
            start_exchange,
            recv,
            send,
            fused=fused,
            barrier=barrier,
            collective=self._collective,
            group=self.ep.group,
            peer_blocks=peer_blocks,
        )

    def _layout(self, recv_SB: torch.Tensor, fmt: RowFormat) -> Callable[[], Any]:
        """The receiver's expert-major layout of ``recv_SB``, as a call that holds no reference to
        ``self`` (the ``layout`` graph keeps it)."""
        return functools.partial(
            self._index_kernels().expert_layout, recv_SB[: self.num_slots], fmt, self.ep.rank, self.num_local_experts
        )

    def _pack(
        self, x_TH, ids_TK, weights_TK, bufs: Buffers, slot_TP: torch.Tensor, fmt: RowFormat
    ) -> Callable[[], None]:
        """The fused send plan and row copy into the round's blocks, and the id check, as a call
        that holds no reference to ``self`` (the ``pack`` graph keeps it)."""
        return functools.partial(
            _pack_checked,
            self._index_kernels(),
            x_TH,
            ids_TK,
            weights_TK,
            bufs.dispatch_dst,
            slot_TP,
            fmt,
            self.num_local_experts,
            self.capacity,
            self.num_experts,
        )

    def _pack_staged(
        self, graphs: RoundGraphs, inp: DispatchInput, bufs: Buffers, fmt: RowFormat
    ) -> tuple[torch.Tensor, list]:
        """``_pack`` through the round's ``pack`` graph, which stages the caller's tensors itself ->
        (``slot_TP``, a view of the round's ``slot_CP`` valid until the round's buffers are reused;
        the works to wait on).

        With symmetric memory the transfer's start (nothing for ``symm_mem``, the peer copies for
        ``copy_engine``) is captured in the ``pack`` graph and its end (the barrier) in the
        ``layout`` graph, so the works returned are none; an NCCL collective stays outside."""
        x_TH = inp.x_TH
        if graphs.staging is None:
            graphs.staging = Staging.allocate(
                self.capacity, fmt.hidden, fmt.top_k, self.ep.size, fmt.dtype, x_TH.device
            )
        st = graphs.staging
        in_graph = bufs.dispatch_barrier is not None
        if graphs.pack is None:
            addresses = CallerAddresses(bufs.dispatch_recv_SB, 4)  # T, then x, ids and weights
            pack_rows = self._pack(st.x_CH, st.ids_CK, st.weights_CK, bufs, st.slot_CP, fmt)
            start_transfer = graphs.start_dispatch = self._start_transfer(bufs, "dispatch", fused=True)

            def pack() -> None:
                stage_inputs(addresses, st.x_CH, st.ids_CK, st.weights_CK)
                pack_rows()
                if in_graph:
                    start_transfer()  # its one work is the set's barrier, which ``layout`` waits on

            graphs.pack = PieceGraph(pack, capture=x_TH.device.type == "cuda", addresses=addresses)
        table = graphs.pack.addresses
        assert table is not None and graphs.start_dispatch is not None  # set with the pack graph
        values, read = st.pack_values(table, x_TH, inp.topk_ids_TK, inp.topk_weights_TK)  # read: held until queued
        graphs.pack(*values)
        works = [] if in_graph else graphs.start_dispatch()
        return st.slot_TP(values[0]), works

    def _wait_dispatch(self, pending: Pending) -> DispatchOutput:
        pending.wait()
        s: _Round = pending.state
        self._check_round(s.generation)
        sets, fmt, recv_SB = s.sets, s.sets.fmt, s.buffers.dispatch_recv_SB
        fixed: Any  # FixedLayout (torch path) or ll_kernels.KernelLayout (fused kernels)
        rows_R = None
        if sets.fused:
            if s.graphs is None:
                fixed = self._layout(recv_SB, fmt)()
                if sets.in_place:
                    expert_x_RH, scales_RQ = fmt.x(recv_SB), None
                else:
                    expert_x_RH, scales_RQ = ll_kernels.gather_rows(recv_SB, fixed, fmt, keep_fp8=self.deliver_fp8)
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

    def _layout_staged(self, s: _Round) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        """The round's ``layout`` graph -> (the receiver's layout, the expert rows and their scales;
        with ``index_rows`` (``in_place``), the receive buffer's rows [S + 1, H] and None).

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
            layout, barrier = self._layout(recv_SB, fmt), s.buffers.dispatch_barrier
            addresses = None if in_place else CallerAddresses(recv_SB, 2)  # the rows, then their scales
            gather = functools.partial(ll_kernels.gather_rows, recv_SB, fmt=fmt, keep_fp8=keep_fp8, addresses=addresses)

            def end_and_layout() -> Any:
                if barrier is not None:  # the pack graph started a symmetric-memory transfer
                    barrier.wait()
                fixed = layout()
                if not in_place:
                    gather(fixed=fixed)
                return fixed

            graphs.layout = PieceGraph(end_and_layout, capture=recv_SB.device.type == "cuda", addresses=addresses)
            graphs.layout_built_for = built_for
            graphs.expert_rows = graphs.combine = None
        if in_place:
            if graphs.received_rows is None:
                with torch.inference_mode(False):  # a normal view: later forwards may run under plain no_grad
                    graphs.received_rows = fmt.x(recv_SB)
            return graphs.layout(), graphs.received_rows, None
        num_rows = self.num_slots * fmt.top_k
        if not self.fixed_expert_rows:
            rows = ll_kernels.expert_rows(num_rows, fmt, keep_fp8, recv_SB.device)
        elif graphs.expert_rows is None:
            with torch.inference_mode(False):  # written by later forwards under plain no_grad too
                rows = graphs.expert_rows = ll_kernels.expert_rows(num_rows, fmt, keep_fp8, recv_SB.device)
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
                ll_kernels.reduce_pairs(
                    inp.expert_y_RH.to(handle.dtype).contiguous(),  # the blocks hold the activation dtype
                    handle.fixed,
                    bufs.dispatch_recv_SB,
                    r.sets.fmt,
                    bufs.combine_dst,
                    self.capacity,
                )
            else:
                bufs.combine_send_SH.copy_(reduce_pairs(inp.expert_y_RH, handle.fixed))
            works = self._start_transfer(bufs, "combine", fused)()
        return Pending(works=works, state=(fused, staged), traffic=r.sets.combine_traffic)

    def _combine_staged(self, expert_y_RH: torch.Tensor, handle: LowLatencyHandle) -> list:
        """``reduce_pairs`` (and with symmetric memory the transfer's start) from the set's
        ``combine`` graph, reading the experts' output where it lies -> the works to wait on (an
        NCCL collective, called after the replay; none with symmetric memory, whose barrier ends
        the ``combine_end`` graph)."""
        graphs, bufs, fmt = handle.round.graphs, handle.round.buffers, handle.round.sets.fmt
        assert graphs is not None
        in_graph = bufs.combine_barrier is not None
        if graphs.combine is None:
            addresses = CallerAddresses(bufs.combine_dst.anchor, 1)  # the experts' output
            layout, dst, recv_SB, capacity = graphs.layout, bufs.combine_dst, bufs.dispatch_recv_SB, self.capacity
            assert layout is not None  # the round's dispatch went through it
            y_like = torch.empty(1, fmt.hidden, dtype=fmt.dtype, device=recv_SB.device)  # its dtype and H
            start = graphs.start_combine = self._start_transfer(bufs, "combine", fused=True)

            def reduce_and_send() -> None:
                # The layout piece's last outputs: this round's (its captured tensors on CUDA).
                ll_kernels.reduce_pairs(y_like, layout.outputs, recv_SB, fmt, dst, capacity, addresses=addresses)
                if in_graph:
                    start()  # copy_engine's peer copies; symm_mem's kernel already wrote the blocks

            graphs.combine = PieceGraph(reduce_and_send, capture=recv_SB.device.type == "cuda", addresses=addresses)
        table = graphs.combine.addresses
        assert table is not None and graphs.start_combine is not None  # set with the combine graph
        y_RH = readable(expert_y_RH, fmt.dtype)  # held until the replay is queued
        graphs.combine(table.offset_of(y_RH))
        return [] if in_graph else graphs.start_combine()

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
        """``gather_sum`` of the returned rows from the set's ``combine_end`` graph (with symmetric
        memory after the transfer's end, the barrier), into a y [T, H] made here."""
        graphs, bufs = handle.round.graphs, handle.round.buffers
        assert graphs is not None and graphs.staging is not None
        if graphs.combine_end is None:
            addresses = CallerAddresses(bufs.dispatch_recv_SB, 2)  # T, then y
            recv_SH, slot_CP, barrier = bufs.combine_slots_SH, graphs.staging.slot_CP, bufs.combine_barrier
            y_like = torch.empty(1, dtype=handle.dtype, device=recv_SH.device)

            def end_and_sum() -> None:
                if barrier is not None:  # the combine graph's kernel wrote into the peers' buffers
                    barrier.wait()
                ll_kernels.sum_returned(recv_SH, slot_CP, y_like, addresses)

            graphs.combine_end = PieceGraph(end_and_sum, capture=recv_SH.device.type == "cuda", addresses=addresses)
        table = graphs.combine_end.addresses
        assert table is not None
        y_TH = torch.empty(
            handle.num_tokens, handle.hidden_size, dtype=handle.dtype, device=bufs.combine_send_SH.device
        )
        graphs.combine_end(handle.num_tokens, table.offset_of(y_TH))
        return y_TH


def _pack_checked(
    kernels,
    x_TH,
    ids_TK,
    weights_TK,
    dst,
    slot_TP,
    fmt: RowFormat,
    num_local_experts: int,
    capacity: int,
    num_experts: int,
) -> None:
    """``kernels.pack_rows``, then a device-side assert that every id was in range (CUDA)."""
    ids_ok_C = kernels.pack_rows(x_TH, ids_TK, weights_TK, dst, slot_TP, fmt, num_local_experts, capacity)
    if x_TH.device.type == "cuda":
        torch._assert_async(ids_ok_C.amin(), f"topk_ids must lie in [-1, {num_experts})")


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
