"""The dispatcher contract: two phases (launch, then wait) for dispatch and for combine, with hooks.

Legend: see ``moe_sbo/__init__.py``.

::

    dispatch_launch:  pre_dispatch hooks -> validate -> _launch_dispatch -> dispatch_in_flight hooks
    dispatch_wait:    _wait_dispatch -> post_dispatch hooks            -> DispatchOutput
    combine_launch:   pre_combine hooks -> validate -> _launch_combine -> combine_in_flight hooks
    combine_wait:     _wait_combine -> post_combine hooks               -> y [T, H]

The hard part is keeping the hooks on every path: ``dispatch()``/``combine()`` are just launch
followed by wait, and two-batch overlap calls launch and wait separately with other work between,
so hooks fire identically either way. Subclasses implement only the four ``_`` methods and never
see the hooks; nothing here replaces a method on an instance. The records the phases pass on
(payloads, handles, ``Traffic``) are in ``records.py``.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .. import env
from ..hooks import HookRegistry
from ..profiling import annotate
from .records import CombineInput, DispatchHandle, DispatchInput, DispatchOutput, Pending, Traffic

# The CTAs, so SMs, an NCCL all-to-all holds while it runs beside compute when NCCL_MAX_CTAS does not
# cap them: NCCL picks its channel count per communicator and does not report it. 4 is where a
# two-batch-overlap GEMM budget was fastest on 2x H200, NCCL 2.28, over NCCL's host-memory path (the
# inter-node-class wire): 128 of 132 SMs, against 100, 120, 124 and all 132 (docs/BENCHMARKS.md,
# "Two-batch overlap with a GEMM budget"). Over NVLink NCCL may run more channels; a 128-SM budget
# left TBO's speed there unchanged (within 3 %, same page).
NCCL_TRANSFER_SMS = 4


def nccl_transfer_sms() -> int:
    """SMs an NCCL transfer holds while it runs: ``NCCL_MAX_CTAS`` when set, else ``NCCL_TRANSFER_SMS``."""
    cap = env.nccl_max_ctas()
    return cap if cap is not None else NCCL_TRANSFER_SMS


@dataclass
class EPGroup:
    """The expert-parallel group: ``rank`` in ``[0, size)``; ``group=None`` is the default group.

    ``ranks_per_node``: consecutive ranks that share a node (a fast intra-node link); ``None``: all of
    them (one node). Node-aware dispatch sends across nodes once per destination node, and every
    dispatcher counts the bytes that cross nodes (``Traffic.inter_node_bytes``) by it.
    """

    group: Any = None
    rank: int = 0
    size: int = 1
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        g = self.ranks_per_node
        if g is not None and (g < 1 or self.size % g):
            raise ValueError(
                f"ranks_per_node must divide the EP size {self.size}, got {g}; set MOE_SBO_RANKS_PER_NODE "
                "(or torchrun's LOCAL_WORLD_SIZE) to the ranks of one node"
            )

    @property
    def node_size(self) -> int:
        """Ranks per node (the whole group when one node holds it)."""
        return self.ranks_per_node or self.size

    @classmethod
    def from_torch(cls, group: Any = None) -> EPGroup:
        if not dist.is_available() or not dist.is_initialized():
            if group is not None:
                raise ValueError(
                    "group was given but torch.distributed is not initialised; call "
                    "moe_sbo.launch.group.init_from_torchrun() (or use LocalRanks) first, or pass group=None"
                )
            return cls()
        size = dist.get_world_size(group)
        return cls(group=group, rank=dist.get_rank(group), size=size, ranks_per_node=env.ranks_per_node(size))


class Dispatcher:
    """Moves tokens to the ranks owning their experts and brings the outputs back.

    One instance per layer and EP group. ``hooks`` is this dispatcher's ``HookRegistry``;
    ``last_traffic`` the bytes of the last finished dispatch + combine (recorded by ``combine_wait``).
    ``deliver_fp8``: when the scheme sends fp8 (``sends_fp8``), hand the rows to the experts as they
    arrived, e4m3 with their scales, instead of dequantising them (set by a layer with FP8 experts).
    """

    name: ClassVar[str] = "base"
    # Whether a whole forward can be captured in a CUDA graph (fixed shapes, no host reads).
    graph_capturable: ClassVar[bool] = False
    # At EP > 1 the scheme's count exchange carries the expert-id check (see ``_ids_in_range``).
    checks_ids_in_count_exchange: ClassVar[bool] = False

    @property
    def capacity(self) -> int | None:
        """The most tokens a rank may dispatch per forward; None: any number (variable-size schemes)."""
        return None

    def __init__(self, num_experts: int, ep: EPGroup):
        if num_experts % ep.size:
            raise ValueError(
                f"num_experts must be divisible by the EP size, got {num_experts} experts on {ep.size} "
                f"ranks; use an EP size that divides {num_experts}"
            )
        self.num_experts = num_experts
        self.ep = ep
        self.num_local_experts = num_experts // ep.size
        self.first_local_expert = ep.rank * self.num_local_experts
        self.hooks = HookRegistry()
        self.last_traffic = Traffic()
        self.deliver_fp8 = False
        self.options: dict[str, Any] = {}  # the keyword options ``make_dispatcher`` built it with
        # Input signatures whose structure ``_check_dispatch_input`` passed (``_validate_dispatch_input``).
        self._signatures_checked: set[tuple] = set()

    @property
    def sends_fp8(self) -> bool:
        """Whether dispatch puts e4m3 activations on the wire (``deliver_fp8`` can then keep them)."""
        return False

    def twin(self) -> Dispatcher:
        """A dispatcher for a second micro-batch: the same group and buffers, its own hooks.

        Two-batch overlap runs two forwards interleaved; each needs its own hooks so a strategy
        attaches to one micro-batch only. Whatever the scheme keeps between forwards (buffers and
        the round counter of ``low_latency``) is shared, so two rounds in flight use the scheme's
        own double buffering.
        """
        rounds = self.max_rounds_in_flight()
        if rounds is not None and rounds < 2:
            raise ValueError(
                f"a twin {self.name} dispatcher (two-batch overlap) needs 2 rounds in flight, but this one "
                f"keeps {rounds}; build it with num_buffers=2 or more"
            )
        twin = copy.copy(self)
        twin.hooks = HookRegistry()
        twin.last_traffic = Traffic()
        return twin

    def max_rounds_in_flight(self) -> int | None:
        """How many dispatches may be in flight (launched, not yet combined) at once; None: any number
        (schemes that allocate per forward)."""
        return None

    def transfer_sms(self, device: torch.device) -> int:
        """SMs this scheme's transfer holds while the current stream computes on ``device``: NCCL's
        CTAs (``nccl_transfer_sms``) when the payload moves by an NCCL collective on NCCL's own stream
        (CUDA, EP > 1); 0 where nothing runs beside the compute (CPU, one rank)."""
        return nccl_transfer_sms() if device.type == "cuda" and self.ep.size > 1 else 0

    # ---- the public two-phase API -------------------------------------------------------------

    def dispatch_launch(self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> Pending:
        """Start moving each token to the ranks that own its top-k experts.

        Sync: runs ``pre_dispatch`` hooks, validates (one host read of the id range), exchanges the
        row and pair counts (the host blocks on that small collective in the variable-size schemes:
        it sizes the receive buffers), then starts the payload transfer and returns
        at once, after the ``dispatch_in_flight`` hooks ran. On CUDA the transfer runs on the
        communicator's stream; read nothing until ``dispatch_wait``.
        """
        inp = self.hooks.run("pre_dispatch", self, DispatchInput(x_TH, topk_ids_TK, topk_weights_TK))
        try:
            self._validate_dispatch_input(inp)
        except (ValueError, TypeError):
            # Input seen bad on this rank only: tell the others through the scheme's own first
            # collective (if it has one) so they raise at once instead of waiting in it.
            self._announce_rejected_input()
            raise
        with annotate("dispatch", phase="dispatch_launch"):
            pending = self._launch_dispatch(inp)
        self.hooks.run("dispatch_in_flight", self, pending)
        return pending

    def dispatch_wait(self, pending: Pending) -> DispatchOutput:
        """Finish a dispatch and lay the received rows out by local expert.

        Sync: waits for the transfer (CPU: the host blocks; CUDA: only the current stream waits on
        the communicator's, the host goes on: the pair count R came with the row counts at launch);
        builds the expert-major layout on the device; then runs the ``post_dispatch`` hooks. Not
        CUDA-graph safe (variable sizes).
        """
        with annotate("dispatch", phase="dispatch_wait"):
            out = self._wait_dispatch(pending)
        return self.hooks.run("post_dispatch", self, out)

    def dispatch(self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> DispatchOutput:
        """``dispatch_wait(dispatch_launch(...))``. Sync: as those two."""
        return self.dispatch_wait(self.dispatch_launch(x_TH, topk_ids_TK, topk_weights_TK))

    def combine_launch(self, expert_y_RH: torch.Tensor, handle: DispatchHandle) -> Pending:
        """Start sending the weighted expert outputs back to the tokens' ranks.

        Sync: runs ``pre_combine`` hooks, reduces each received row's pairs (float32 accumulate,
        sent in the activation dtype), starts the transfer and returns at once after the
        ``combine_in_flight`` hooks ran. Read nothing until ``combine_wait``.
        """
        inp = self.hooks.run("pre_combine", self, CombineInput(expert_y_RH, handle))
        self._check_combine_input(inp)
        with annotate("combine", phase="combine_launch"):
            pending = self._launch_combine(inp)
        pending.handle = inp.handle
        self.hooks.run("combine_in_flight", self, pending)
        return pending

    def combine_wait(self, pending: Pending, out: torch.Tensor | None = None) -> torch.Tensor:
        """Finish a combine: ``y_TH`` [T, H] in the activation dtype, then ``post_combine`` hooks.

        ``out``: a contiguous [T, H] tensor of the activation dtype that receives ``y_TH`` (written
        directly where the scheme can, else copied), for callers that own the output's memory.

        Sync: the current stream (CUDA) or the host (CPU) waits for the transfer.
        """
        if out is not None:
            h = pending.dispatch_handle
            if tuple(out.shape) != (h.num_tokens, h.hidden_size) or out.dtype != h.dtype or not out.is_contiguous():
                raise ValueError(
                    f"out must be a contiguous {h.dtype} [{h.num_tokens}, {h.hidden_size}], got {out.dtype} "
                    f"{tuple(out.shape)}"
                )
        with annotate("combine", phase="combine_wait"):
            y_TH = self._wait_combine(pending) if out is None else self._wait_combine_into(pending, out)
        self.last_traffic = pending.dispatch_handle.traffic + pending.traffic
        return self.hooks.run("post_combine", self, y_TH)

    def combine(self, expert_y_RH: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """``combine_wait(combine_launch(...))``. Sync: as those two."""
        return self.combine_wait(self.combine_launch(expert_y_RH, handle))

    # ---- what each scheme implements -----------------------------------------------------------

    def _launch_dispatch(self, inp: DispatchInput) -> Pending:
        raise NotImplementedError

    def _wait_dispatch(self, pending: Pending) -> DispatchOutput:
        raise NotImplementedError

    def _launch_combine(self, inp: CombineInput) -> Pending:
        raise NotImplementedError

    def _wait_combine(self, pending: Pending) -> torch.Tensor:
        raise NotImplementedError

    def _wait_combine_into(self, pending: Pending, out_TH: torch.Tensor) -> torch.Tensor:
        """``_wait_combine`` into ``out_TH`` (checked by ``combine_wait``); schemes that can write it
        directly override this."""
        return out_TH.copy_(self._wait_combine(pending))

    def _announce_rejected_input(self) -> None:
        """Join this scheme's first dispatch collective with a "rejected" sentinel. Schemes without a
        count exchange (``local``; ``low_latency``, which must not sync) do nothing: there the
        launcher's fail-fast ends the other ranks."""

    # ---- shared helpers ------------------------------------------------------------------------

    def _counts_device(self) -> torch.device:
        """Where this group's small count tensors live: the current GPU for NCCL, else the CPU."""
        if self.ep.size > 1 and dist.get_backend(self.ep.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _raise_if_rejected(self, rejected_ranks: list[int], ids_TK: torch.Tensor | None = None) -> None:
        """After the count exchange: raise if any rank sent the "rejected" sentinel; this rank's own
        rejection (bad ``ids_TK``, checked inside the exchange) raises the named id-range error."""
        if self.ep.rank in rejected_ranks and ids_TK is not None:
            self._raise_bad_ids(int(ids_TK.min()), int(ids_TK.max()))
        if rejected_ranks:
            raise ValueError(
                f"rank(s) {rejected_ranks} rejected their dispatch input (their own error names the "
                "problem); every rank ends this forward before any data moved"
            )

    def _local_ids(self, ids_MK: torch.Tensor, owner_rank: int | torch.Tensor) -> torch.Tensor:
        """Global expert ids -> ids local to ``owner_rank`` (``-1`` for other ranks' experts)."""
        first = owner_rank * self.num_local_experts
        local = ids_MK - first
        return torch.where((local >= 0) & (local < self.num_local_experts), local, -1)

    def _output(
        self,
        expert_x_RH: torch.Tensor,
        handle: DispatchHandle,
        scales_RQ: torch.Tensor | None = None,
        expected_rows: int | None = None,
        rows_R: torch.Tensor | None = None,
    ) -> DispatchOutput:
        return DispatchOutput(
            expert_x_RH, handle.layout.num_rows_per_expert_L, handle, scales_RQ, expected_rows, rows_R
        )

    def _validate_dispatch_input(self, inp: DispatchInput) -> None:
        """Per-rank checks before any collective (a bad rank raises instead of hanging the rest):
        ``_check_dispatch_input`` once per input signature, ``_check_topk_ids`` every call.

        The structural checks read only what the signature holds (shapes, dtypes, devices, grad mode),
        so a signature that passed once passes again. They cost an eager decode step's host ~10 µs a
        call on an H200 host, and a decode loop passes the same signature every step; the ids' values
        are data and are checked each time."""
        x, ids, weights = inp.x_TH, inp.topk_ids_TK, inp.topk_weights_TK
        shapes = (x.shape, ids.shape, weights.shape, x.dtype, ids.dtype, weights.dtype)
        signature = (*shapes, x.device, ids.device, weights.device, torch.is_grad_enabled())
        if signature not in self._signatures_checked:
            self._check_dispatch_input(inp)
            if len(self._signatures_checked) >= MAX_SIGNATURES_KEPT:
                self._signatures_checked.clear()  # prefill passes a new T each forward: keep a bounded set
            self._signatures_checked.add(signature)
        self._check_topk_ids(ids)

    def _check_dispatch_input(self, inp: DispatchInput) -> None:
        """Structural checks of a dispatch input: what its shapes, dtypes, devices and the grad mode
        decide (schemes add theirs); the ids' values are ``_check_topk_ids``'."""
        x, ids, weights = inp.x_TH, inp.topk_ids_TK, inp.topk_weights_TK
        if x.dim() != 2:
            raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}; flatten batch and sequence first")
        if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
            raise ValueError(f"topk_ids must be [T, K] with T = {x.shape[0]} rows of x, got shape {tuple(ids.shape)}")
        if weights.shape != ids.shape:
            raise ValueError(
                f"topk_weights must have the shape of topk_ids {tuple(ids.shape)}, got {tuple(weights.shape)}"
            )
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids must be int32 or int64, got {ids.dtype}")
        if not weights.is_floating_point():
            raise TypeError(f"topk_weights must be floating point, got {weights.dtype}")
        if ids.device != x.device or weights.device != x.device:
            raise ValueError(
                f"x, topk_ids and topk_weights must be on one device, got {x.device}, {ids.device}, "
                f"{weights.device}; move them with .to(x.device)"
            )

    def _check_topk_ids(self, ids_TK: torch.Tensor) -> None:
        """Ids in ``[0, E)``. One host read of the id range; schemes that must not sync override this,
        and schemes with a count exchange check inside it instead (no read of its own)."""
        if self.checks_ids_in_count_exchange and self.ep.size > 1:
            return
        if ids_TK.numel():
            lo, hi = torch.stack([ids_TK.min(), ids_TK.max()]).tolist()  # one host sync for both
            if lo < 0 or hi >= self.num_experts:
                self._raise_bad_ids(lo, hi)

    def _raise_bad_ids(self, lo: int, hi: int) -> None:
        raise ValueError(
            f"topk_ids must lie in [0, {self.num_experts}), got values in [{lo}, {hi}]; "
            "the router and the dispatcher disagree on the expert count"
        )

    def _ids_in_range(self, ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For a count exchange that carries the id check: (``ok``, a 0-dim bool on the device: all ids
        in ``[0, E)``; ``owner_TK``: each id's rank, 0 where the id is bad so counting stays in range).
        The scheme sends ``REJECTED`` instead of its counts when ``ok`` is false, and after the
        exchange's one host read ``_raise_if_rejected`` names the problem on every rank."""
        valid_TK = (ids_TK >= 0) & (ids_TK < self.num_experts)
        owner_TK = torch.div(ids_TK.long(), self.num_local_experts, rounding_mode="floor")
        return valid_TK.all(), torch.where(valid_TK, owner_TK, 0)

    def _check_combine_input(self, inp: CombineInput) -> None:
        expected = (inp.handle.layout.row_R.shape[0], inp.handle.hidden_size)
        if tuple(inp.expert_y_RH.shape) != expected:
            raise ValueError(
                f"expert_y must be [R, H] = {expected} (one row per dispatched row), got {tuple(inp.expert_y_RH.shape)}"
            )


# Input signatures a dispatcher remembers as checked; a new one past this clears the set.
MAX_SIGNATURES_KEPT = 64

# A count no rank can send: "my input was rejected" in the count exchanges of allgather/alltoall.
REJECTED = -1

DISPATCHERS: dict[str, type[Dispatcher]] = {}


def register_dispatcher(cls: type[Dispatcher]) -> type[Dispatcher]:
    """Class decorator: make ``cls`` selectable by ``cls.name``."""
    DISPATCHERS[cls.name] = cls
    return cls


def dispatcher_option_names(name: str) -> tuple[str, ...]:
    """The keyword options the dispatcher called ``name`` accepts (its constructor's keyword-only ones)."""
    params = inspect.signature(DISPATCHERS[name].__init__).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def options_for_tokens(name: str, tokens_per_rank: int) -> dict[str, int]:
    """Options sizing a fixed-capacity dispatcher for ``tokens_per_rank`` (none for the others)."""
    if "max_tokens_per_rank" in dispatcher_option_names(name):
        return {"max_tokens_per_rank": max(tokens_per_rank, 1)}
    return {}


def make_dispatcher(name: str, num_experts: int, ep: EPGroup, **options: Any) -> Dispatcher:
    """The dispatcher called ``name`` for ``num_experts`` experts over ``ep``.

    ``options`` are passed to its constructor (e.g. ``max_tokens_per_rank`` for ``low_latency``); an
    option the scheme does not take is an error, not silently ignored.
    """
    if name not in DISPATCHERS:
        raise ValueError(f"dispatcher must be one of {sorted(DISPATCHERS)}, got {name!r}")
    accepted = dispatcher_option_names(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"dispatcher options must be among {list(accepted)} for {name!r}, got {unknown}; "
            "drop them or choose the dispatcher that takes them"
        )
    dispatcher = DISPATCHERS[name](num_experts, ep, **options)
    dispatcher.options = dict(options)
    return dispatcher
