"""``LowLatencyOptions``: the eight constructor options of the ``low_latency`` dispatcher, checked
together when made, and the check that every rank of the EP group built its dispatcher alike.

The hard part is that the options multiply into execution paths (torch or fused kernels; NCCL,
symmetric memory or the copy engines; direct launches or replayed index graphs; rows copied or read
in place), and some pairs cannot run together. Every such pair is refused here, before any
collective, with the fix in the message; ``check_input`` does the same for each dispatch's input
against what the dispatcher resolved for its device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...kernel_choice import interpreting
from ...quant.fp8 import FP8_GROUP
from ..base import EPGroup

KERNELS = ("auto", "triton", "torch")
TRANSPORTS = ("auto", "nccl", "symm_mem", "copy_engine")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class LowLatencyOptions:
    """What a ``LowLatencyDispatcher`` is built with (its keyword options, same names).

    ``max_tokens_per_rank`` (C): the most tokens any rank may pass to one dispatch; more raise
    ``ValueError`` before any collective. ``fp8``: send x as e4m3 with a float32 scale per token and
    128 values (H must be a multiple of 128), dequantised on arrival (or handed to FP8 experts as
    they arrived: ``deliver_fp8``, set by ``MoELayer(expert_dtype="fp8")``); combine stays in the
    activation dtype. ``num_buffers``: buffer sets used in turn, so that many rounds may be in flight
    at once (2, as DeepEP: one per micro-batch of two-batch overlap); a round whose buffers a later
    round took raises instead of reading them.

    ``kernels``: ``"triton"`` runs the five fused kernels (``kernels/`` and ``reduce.gather_sum``;
    CUDA, or CPU under ``TRITON_INTERPRET=1``); ``"torch"`` the reference chain of torch ops (any
    device); ``"auto"`` Triton on CUDA when it imports, torch otherwise. Both produce the same bytes
    on the wire and the same layout; combine sums in float32 either way (the order differs, so bf16
    results may differ by an ulp between the two, never run to run).

    ``transport``: ``"nccl"`` a fixed-size ``all_to_all_single`` per phase (portable, capturable;
    gloo on CPU); ``"symm_mem"`` PyTorch symmetric memory: the fused kernels write each block
    straight into the peer's receive buffer over NVLink and the phase ends with a symmetric-memory
    barrier (CUDA and ``kernels="triton"`` only; buffers are rendezvoused on the first forward);
    ``"copy_engine"``: the kernels fill a local send buffer, then one peer copy per block
    (``cudaMemcpyAsync`` into the peer's symmetric receive buffer: the GPU's copy engines move the
    bytes, no SMs, so compute on other streams keeps every SM) and a barrier (CUDA, either kernels);
    ``"auto"`` (default) ``symm_mem`` where it can run (CUDA, fused kernels, EP > 1 within one node
    whose GPUs reach each other; which is faster where: docs/BENCHMARKS.md), ``nccl`` elsewhere.

    ``index_graphs`` (default True, fused kernels only): every kernel of both phases runs from four
    CUDA graphs per buffer set, captured on the set's first eager forward and replayed after; the
    caller's tensors (x, ids, weights, the expert rows, the experts' output, y) are read and written
    where they lie, through address tables the host writes before each replay (``addresses.py``),
    so an eager phase costs the host one or two replays at any T (``graphs.py``). Under a caller's
    own graph capture the kernels run directly; on CPU the same pieces run without capture. False:
    launch the kernels on every forward.

    ``fixed_expert_rows`` (default False; with ``index_graphs``): the ``layout`` graph gathers the
    expert rows into a buffer kept per set, as DeepEP's low-latency receive buffers, instead of rows
    allocated per forward: the rows handed out (``expert_x_RH`` and its scales) are then valid until
    the set's next round, ``num_buffers`` dispatches later, as the layout's counts already are.

    ``index_rows`` (default False; fused kernels): leave the received rows where the transfer put
    them instead of copying every (token, local expert) row into expert order: the dispatch hands
    out the receive buffer's rows and the layout's index (``DispatchOutput.expert_rows_R``), and the
    experts' tiled GEMM reads its rows through it, as FP8 experts' quantisation does (other kernels
    gather them first). fp8 rows stay in place only where the dispatcher delivers them as fp8
    (``deliver_fp8``: e4m3 values and their scales, both views); dequantised rows are copies.
    Refused with ``kernels="torch"``, which copies the rows; with ``kernels="auto"`` where the torch
    path runs (no Triton), the rows are copied as there.

    Raises ``ValueError`` when made with a value out of range or a pair that cannot run together.
    """

    max_tokens_per_rank: int = 128
    fp8: bool = False
    num_buffers: int = 2
    kernels: str = "auto"
    transport: str = "auto"
    index_graphs: bool = True
    fixed_expert_rows: bool = False
    index_rows: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp8", bool(self.fp8))  # any truthy value, as the dispatcher always took
        for option, value in (("max_tokens_per_rank", self.max_tokens_per_rank), ("num_buffers", self.num_buffers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} must be an int >= 1, got {value!r}")
        flags = (
            ("index_graphs", self.index_graphs),
            ("fixed_expert_rows", self.fixed_expert_rows),
            ("index_rows", self.index_rows),
        )
        for option, flag in flags:
            if not isinstance(flag, bool):
                raise ValueError(f"{option} must be True or False, got {flag!r}")
        if self.fixed_expert_rows and not self.index_graphs:
            raise ValueError(
                "fixed_expert_rows gathers the expert rows inside the index graphs; use it with index_graphs=True"
            )
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.index_rows and self.kernels == "torch":
            raise ValueError(
                "index_rows leaves the received rows in place for the fused kernels' layout, but "
                "kernels='torch' gathers them; use kernels='triton' or 'auto' with it, or leave index_rows off"
            )
        if self.transport == "symm_mem" and self.kernels == "torch":
            raise ValueError(
                "transport='symm_mem' writes into the peers' buffers from the fused Triton kernels; "
                "use kernels='triton' or 'auto' with it, or transport='nccl' with kernels='torch'"
            )

    def check_input(self, x_TH: torch.Tensor, fused: bool, transport: str, collective: bool) -> None:
        """Refuse a dispatch input these options cannot carry, before any collective: more than C
        tokens, an fp8 H that is not a multiple of 128, rows the fused kernels cannot store 16 bytes
        at a time (``fused``: they run here), ``kernels="triton"`` off CUDA without the interpreter,
        a symmetric-memory ``transport`` (resolved) off CUDA or without a process group
        (``collective``)."""
        num_tokens, hidden = x_TH.shape
        capacity = self.max_tokens_per_rank
        if num_tokens > capacity:
            raise ValueError(
                f"tokens per rank must be <= max_tokens_per_rank = {capacity} of this low_latency "
                f"dispatcher, got T = {num_tokens}; split the batch into chunks of at most {capacity} "
                "tokens, or build it with a larger capacity (MoELayer(..., dispatcher_options="
                "{'max_tokens_per_rank': N}))"
            )
        if self.fp8 and hidden % FP8_GROUP:
            raise ValueError(
                f"hidden size must be a multiple of {FP8_GROUP} for fp8 dispatch (one scale per {FP8_GROUP} "
                f"values), got H = {hidden}; use fp8=False for this model"
            )
        device = x_TH.device
        if fused and hidden * x_TH.element_size() % 16:
            raise ValueError(
                f"the fused low_latency kernels need rows of a multiple of 16 bytes, got H = {hidden} x "
                f"{x_TH.element_size()} bytes; use kernels='torch' for this model"
            )
        if self.kernels == "triton" and device.type != "cuda" and not interpreting():
            raise ValueError(
                f"kernels='triton' needs CUDA tensors (or TRITON_INTERPRET=1, Triton's CPU interpreter), got x on "
                f"{device}; use kernels='auto' or 'torch' here"
            )
        if transport in ("symm_mem", "copy_engine") and (device.type != "cuda" or not collective):
            raise ValueError(
                f"transport={transport!r} needs CUDA tensors and an initialised NCCL process group (it writes "
                f"into the peers' GPU buffers), got x on {device}"
                f"{'' if collective else ' without a process group'}; use transport='nccl'"
            )

    def needs_triton(self) -> bool:
        """Whether these options cannot run without Triton (the fused kernels are asked for by name)."""
        return self.kernels == "triton" or self.transport == "symm_mem"


def check_built_alike(
    options: LowLatencyOptions,
    num_experts: int,
    ep: EPGroup,
    device: torch.device,
    dtype: torch.dtype,
    hidden: int,
    top_k: int,
    transport: str,
) -> None:
    """Every rank's buffers must have the same layout: a rank with another capacity would send
    blocks of another size (gloo aborts the process, NCCL hangs, symmetric-memory stores land in the
    wrong rows). Compared once, before the first transfer, with one fixed-size all-gather over
    ``ep``; a difference raises the same ``ValueError`` on every rank.

    Sync: a blocking all-gather on the current stream, then a host read of its result; call it
    outside any CUDA-graph capture (the dispatcher calls it when it allocates a shape's buffers)."""
    setup = {
        "max_tokens_per_rank": options.max_tokens_per_rank,
        "num_buffers": options.num_buffers,
        "fp8": int(options.fp8),
        "num_experts": num_experts,
        "hidden size": hidden,
        "top-k": top_k,
        "activation dtype": _DTYPE_CODES.get(dtype, -1),
        "transport": TRANSPORTS.index(transport),
    }
    mine = torch.tensor(list(setup.values()), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(ep.size)]
    dist.all_gather(gathered, mine, group=ep.group)
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
