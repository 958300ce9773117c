"""``low_latency``'s transports: the buffer sets (plain, or symmetric memory the peers write into),
where the kernels write each block (``Destinations``), the round counter that takes the sets in turn,
and one phase's fixed-size transfer (``Exchange``).

Legend: see ``moe_sbo/__init__.py``.

The hard part is who writes where. With NCCL the kernels write each block into this rank's send
buffer and one ``all_to_all_single`` moves it; with symmetric memory (``symm_mem``) the kernels
write straight into the peer's receive buffer over NVLink and the phase ends with a barrier, after
which every peer's writes to this rank are visible; one rank without a collective writes its own
receive buffer. The receive buffers keep one extra row of zeros (index S) that padding rows read.

Every wait is bounded. The NCCL transfer by the process group's timeout; the symmetric-memory
barrier by ``timeout_ms`` (the wait bound, ``MOE_SBO_TIMEOUT_S``), timed on the GPU's global timer
(wall-clock nanoseconds, not clock cycles). A barrier that outlives it does not go on with stale
rows: PyTorch's kernel prints ``[FATAL] ... barrier: rank r failed to receive signal from rank p on
channel c ...`` and traps, which poisons the CUDA context, so the next synchronising call on that
rank raises (``CUDA error: unspecified launch failure``) and the process must end. The channel names
the phase: ``DISPATCH_CHANNEL`` or ``COMBINE_CHANNEL``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ... import env
from ..base import EPGroup
from .wire import RowFormat

# The symmetric-memory barrier's channel per phase. PyTorch's timeout message prints the channel, so it
# says which phase waited; distinct channels also keep the phases apart where buffers share a signal pad.
DISPATCH_CHANNEL = 0
COMBINE_CHANNEL = 1


def barrier_timeout_ms() -> int:
    """The symmetric-memory barriers' bound in milliseconds: the wait bound (0 would mean forever)."""
    return max(1, round(env.collective_timeout_s() * 1000))


@dataclass(frozen=True)
class SymmBarrier:
    """The "work" of a symmetric-memory phase: its data already went out inside the kernel, so
    waiting is a barrier with every peer (after it, their writes to this rank are visible).

    One per buffer set and phase, made with the buffers: ``handle`` the phase's symmetric-memory
    handle, ``channel`` the phase's channel, ``timeout_ms`` the bound (fixed when made; a CUDA graph
    that captured the barrier keeps it too). Sync: ``wait`` queues the barrier kernel on the current
    stream; the host goes on."""

    handle: Any = field(compare=False)
    channel: int
    timeout_ms: int

    def wait(self) -> None:
        self.handle.barrier(channel=self.channel, timeout_ms=self.timeout_ms)


@dataclass(frozen=True)
class Destinations:
    """Where the fused kernels write the block for each rank p: ``anchor`` (a uint8 tensor, 16-byte
    aligned) plus ``offsets_P`` (int64, device) in 16-byte units; all addresses must be 16-byte aligned.

    One kernel serves every transport: the local send buffer's blocks (NCCL), the receive buffer
    itself (one rank, no collective), or the peers' symmetric receive buffers (NVLink writes). Offsets
    from a tensor argument rather than raw addresses let Triton know every row is 16-byte aligned, so
    it stores 16 bytes at a time (from a raw address it must assume 2, far slower over NVLink)."""

    anchor: torch.Tensor
    offsets_P: torch.Tensor

    @classmethod
    def make(cls, anchor: torch.Tensor, addresses: list[int]) -> Destinations:
        base = anchor.data_ptr()
        if base % 16 or any(a % 16 for a in addresses):
            raise ValueError(
                f"block addresses must be 16-byte aligned, got {[hex(a) for a in [base, *addresses]]}; "
                "rows are padded to 16 bytes, so check the hidden size and dtype"
            )
        offsets = [(a - base) // 16 for a in addresses]
        return cls(anchor.view(torch.uint8), torch.tensor(offsets, dtype=torch.int64, device=anchor.device))


@dataclass(frozen=True)
class Exchange:
    """One phase's fixed-size transfer of ``send`` into ``recv`` for one buffer set, made with the
    buffers. ``fused``: the fused kernels wrote the blocks (for ``symm_mem`` straight into the peers'
    buffers; without a collective into ``recv``); ``barrier``: the ``SymmBarrier`` that ends the phase
    (``symm_mem``, ``copy_engine``); ``collective``: a communicator moves the blocks over ``group``;
    ``peer_blocks`` (``copy_engine``): where each block of ``send`` is copied to."""

    recv: torch.Tensor
    send: torch.Tensor
    fused: bool
    barrier: SymmBarrier | None = field(compare=False)
    collective: bool
    group: Any = field(compare=False)
    peer_blocks: list[torch.Tensor] | None = field(default=None, compare=False)

    def start(self) -> list:
        """Start the transfer -> the works to wait on. With the fused kernels the blocks are already
        in place for ``symm_mem`` (a barrier remains) and without a collective (nothing remains);
        ``copy_engine`` copies each block into its peer's buffer and a barrier ends the phase;
        otherwise an all-to-all, or a local copy.

        Sync: runs on the current stream; ``copy_engine``'s copies are peer ``cudaMemcpyAsync`` (the
        copy engines move the bytes, no SMs); the all-to-all is async (its work is returned). The host
        never blocks; each work's ``wait`` makes the current stream wait (CUDA) or blocks (gloo).
        CUDA-graph safe except the NCCL all-to-all, which stays outside the index graphs."""
        if self.peer_blocks is not None:  # copy_engine
            capacity = self.peer_blocks[0].shape[0]
            for p, block in enumerate(self.peer_blocks):
                block.copy_(self.send[p * capacity : (p + 1) * capacity])
            assert self.barrier is not None, "copy_engine ends each phase with a symmetric-memory barrier"
            return [self.barrier]
        if self.fused and self.barrier is not None:  # symm_mem: the kernel wrote into the peers' buffers
            return [self.barrier]
        if not self.collective:
            if not self.fused:
                self.recv.copy_(self.send)
            return []
        return [dist.all_to_all_single(self.recv, self.send, group=self.group, async_op=True)]


@dataclass(frozen=True)
class Buffers:
    """One set of communication buffers, allocated once and reused by every forward that uses it.

    The receive buffers have one extra, never-written row of zeros (index S): the padding slot that
    padding rows gather from. ``*_dst``: where the fused kernels write the block for rank p (the
    send buffer for NCCL, the receive buffer with no collective, the peer's symmetric receive
    buffer for ``symm_mem``); ``*_barrier``: the ``SymmBarrier`` that completes the phase
    (``symm_mem`` and ``copy_engine``; None otherwise); ``*_peer_blocks``: where ``copy_engine``
    copies each block of the send buffer to (the peers' symmetric receive buffers).
    """

    dispatch_send_SB: torch.Tensor
    dispatch_recv_SB: torch.Tensor  # [S + 1, B]
    combine_send_SH: torch.Tensor
    combine_recv_SH: torch.Tensor  # [S + 1, H]
    dispatch_dst: Destinations | None
    combine_dst: Destinations | None
    dispatch_exchange: Exchange = field(compare=False)
    combine_exchange: Exchange = field(compare=False)
    dispatch_barrier: SymmBarrier | None = field(default=None, compare=False)
    combine_barrier: SymmBarrier | None = field(default=None, compare=False)

    @functools.cached_property
    def combine_slots_SH(self) -> torch.Tensor:
        """``combine_recv_SH`` without its padding row, [S, H]: made once (a view per forward costs
        the host a few microseconds)."""
        return self.combine_recv_SH[:-1]


@dataclass
class RoundCounter:
    """Dispatches launched so far by a dispatcher and its twins; round n uses buffer set n % num_buffers."""

    launched: int = 0


@functools.cache  # asked on every forward; the answer is fixed for the process
def peers_reachable(ep_size: int) -> bool:
    """Whether an EP group of ``ep_size`` can be one node's ranks whose GPUs map each other's buffers
    (symmetric memory): the group fits this node (torchrun's ``LOCAL_WORLD_SIZE`` when set), ranks
    placed round-robin on one GPU are allowed to share it (``env.symm_mem_on_shared_gpus``, set by
    ``launch`` when ranks outnumber GPUs), and every pair of the GPUs in use has peer access. The same
    answer on every rank of a node, so ``transport="auto"`` resolves alike everywhere."""
    num_gpus = torch.cuda.device_count()
    if num_gpus < 1 or env.local_world_size(ep_size) < ep_size:
        return False
    if ep_size > num_gpus and not env.symm_mem_on_shared_gpus():
        return False
    used = min(ep_size, num_gpus)
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(used) for b in range(used) if a != b)


def allocate_buffers(
    device: torch.device,
    dtype: torch.dtype,
    fmt: RowFormat,
    ep: EPGroup,
    capacity: int,
    *,
    transport: str,
    collective: bool,
    fused: bool,
    destinations: bool,
) -> Buffers:
    """One buffer set for ``ep.size * capacity`` slots of rows ``fmt``. ``transport``: ``symm_mem`` and
    ``copy_engine`` put the receive buffers in symmetric memory (a collective rendezvous: every rank
    must allocate together); ``collective``: whether a communicator moves the blocks (if not, the
    kernels write the receive buffer directly); ``fused``: whether the fused kernels write the blocks;
    ``destinations``: make the kernels' ``Destinations`` (wherever Triton imports)."""
    s, rank, hidden = ep.size * capacity, ep.rank, fmt.hidden
    dispatch_send = torch.zeros(s, fmt.row_bytes, dtype=torch.uint8, device=device)
    combine_send = torch.zeros(s, hidden, dtype=dtype, device=device)
    barriers: tuple[SymmBarrier | None, SymmBarrier | None] = (None, None)
    peer_blocks: tuple[Any, Any] = (None, None)  # copy_engine: per peer p, this rank's block in p's buffer
    if transport in ("symm_mem", "copy_engine"):
        import torch.distributed._symmetric_memory as symm_mem

        recvs, rendezvous = [], []
        for cols, dt in ((fmt.row_bytes, torch.uint8), (hidden, dtype)):
            recv = symm_mem.empty((s + 1, cols), dtype=dt, device=device).zero_()
            group = ep.group if ep.group is not None else dist.group.WORLD
            assert group is not None, "symmetric memory needs an initialised process group"
            rendezvous.append(symm_mem.rendezvous(recv, group))
            recvs.append(recv)
        handles = (rendezvous[0], rendezvous[1])
        timeout_ms = barrier_timeout_ms()
        barriers = (
            SymmBarrier(handles[0], DISPATCH_CHANNEL, timeout_ms),
            SymmBarrier(handles[1], COMBINE_CHANNEL, timeout_ms),
        )
        # This rank's block in each peer's receive buffer.
        peer = [
            [h.get_buffer(p, (s + 1, cols), dt).data_ptr() for p in range(ep.size)]
            for h, cols, dt in ((handles[0], fmt.row_bytes, torch.uint8), (handles[1], hidden, dtype))
        ]
        dispatch_recv, combine_recv = recvs
        if transport == "symm_mem":  # the kernels write straight into the peers' buffers
            dispatch_dst = [ptr + rank * capacity * fmt.row_bytes for ptr in peer[0]]
            combine_dst = [ptr + rank * capacity * hidden * dtype.itemsize for ptr in peer[1]]
        else:  # copy_engine: the kernels fill the send buffer, then one copy per peer block
            dispatch_dst = [dispatch_send.data_ptr() + p * capacity * fmt.row_bytes for p in range(ep.size)]
            combine_dst = [combine_send.data_ptr() + p * capacity * hidden * dtype.itemsize for p in range(ep.size)]
            peer_blocks = tuple(  # type: ignore[assignment]
                [h.get_buffer(p, (s + 1, cols), dt)[rank * capacity : (rank + 1) * capacity] for p in range(ep.size)]
                for h, cols, dt in ((handles[0], fmt.row_bytes, torch.uint8), (handles[1], hidden, dtype))
            )
        torch.cuda.synchronize(device)
        dist.barrier(group=ep.group)  # every peer zeroed its padding rows before anyone writes
    else:
        dispatch_recv = torch.zeros(s + 1, fmt.row_bytes, dtype=torch.uint8, device=device)
        combine_recv = torch.zeros(s + 1, hidden, dtype=dtype, device=device)
        # NCCL: the blocks go to the send buffer; one rank without a collective: straight to recv.
        d_base, c_base = (dispatch_send, combine_send) if collective else (dispatch_recv, combine_recv)
        dispatch_dst = [d_base.data_ptr() + p * capacity * fmt.row_bytes for p in range(ep.size)]
        combine_dst = [c_base.data_ptr() + p * capacity * hidden * dtype.itemsize for p in range(ep.size)]
    dispatch_barrier, combine_barrier = barriers
    dispatch_blocks, combine_blocks = peer_blocks
    dispatch_exchange = Exchange(
        dispatch_recv[:s], dispatch_send, fused, dispatch_barrier, collective, ep.group, dispatch_blocks
    )
    combine_exchange = Exchange(
        combine_recv[:s], combine_send, fused, combine_barrier, collective, ep.group, combine_blocks
    )
    return Buffers(
        dispatch_send,
        dispatch_recv,
        combine_send,
        combine_recv,
        Destinations.make(dispatch_recv, dispatch_dst) if destinations else None,
        Destinations.make(combine_recv, combine_dst) if destinations else None,
        dispatch_exchange,
        combine_exchange,
        dispatch_barrier,
        combine_barrier,
    )
