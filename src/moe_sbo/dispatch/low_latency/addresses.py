"""The caller's tensors, addressed from inside ``low_latency``'s replayed graphs.

Legend: see ``moe_sbo/__init__.py``; here C is the capacity (``max_tokens_per_rank``).

Why: a CUDA graph bakes in every address it touches, but an eager forward's inputs (x, the router's
ids and weights, the experts' output) and outputs (the expert rows, y) are new tensors each time. A
kernel launched per forward to copy them in or out costs the host what the graph saved (a launch
each). So the graphs read those addresses from a small table instead:

- ``CallerAddresses.write(*values)``: the host writes a forward's values (a token count, and each
  tensor's address as a 16-byte offset from a fixed ``anchor`` tensor) into pinned host memory:
  plain stores, no CUDA call.
- ``fetch`` (the graph's first kernel, one program): copies them into ``table`` on the device, which
  the graph's other kernels read, and echoes the write's sequence number back to the host memory.
- The next ``write`` checks the echo: a table the queued replay has not read yet is never
  overwritten. If the host is that far ahead (a whole round of buffer sets), it synchronises the
  device first, which costs nothing the host was not going to wait for anyway.

The GPU reads the pinned words through unified addressing (an offset from ``anchor``, like
``transport.Destinations``), with a load that does not trust cached copies of host memory. The
echo's value depends on every word read, so it cannot be stored before every read has returned;
the host, seeing it, may overwrite. On CPU (Triton's interpreter, the tests' path) the table is
plain memory and every kernel has finished when its launch returns.

``stage_inputs`` is the ``pack`` graph's staging: x, ids and weights copied from the caller's
tensors into the buffer set's staging, ids -1 past the forward's T tokens.
"""

from __future__ import annotations

import torch

from ...kernel_choice import HAS_TRITON

if HAS_TRITON:  # else the torch path serves; index graphs need the fused kernels
    import triton
    import triton.language as tl

# Words after a table's values: the sequence number of the host's last write, then its echo.
_SEQ, _ECHO = 0, 1
_ALIGN = 16  # offsets count 16-byte units, so the kernels know every address is 16-byte aligned


class CallerAddresses:
    """``size`` int64 values a captured graph reads, rewritten by the host before each replay.

    ``anchor``: a uint8 tensor, 16-byte aligned, that offsets count from (``offset_of``). ``table``:
    the values on the device, where the graph's kernels read them after ``fetch``. Sync: ``write``
    never waits unless the replay that read the previous values is still queued."""

    def __init__(self, anchor: torch.Tensor, size: int):
        if anchor.dtype != torch.uint8 or anchor.data_ptr() % _ALIGN:
            raise ValueError("the anchor must be a 16-byte aligned uint8 tensor")
        device = anchor.device
        with torch.inference_mode(False):  # written by forwards under no_grad and inference_mode alike
            self.host = torch.zeros(size + 2, dtype=torch.int64, pin_memory=device.type == "cuda")
            self.table = torch.zeros(size, dtype=torch.int64, device=device)
        self.anchor = anchor
        self.size = size
        self._on_cuda = device.type == "cuda"
        self._anchor_ptr = anchor.data_ptr()
        self.host_offset = self.offset_of(self.host)
        # The host's stores go through a memoryview of the words: no torch call, no numpy scalar each.
        self._words = self.host.numpy().data.cast("B").cast("q")

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Where ``tensor``'s data lies, for the kernels (it must be 16-byte aligned); an empty
        tensor (nothing is read or written through it) lies at the anchor."""
        if not tensor.numel():
            return 0
        address = tensor.data_ptr()
        if address % _ALIGN:
            raise ValueError(f"address {address:#x} is not {_ALIGN}-byte aligned")
        return (address - self._anchor_ptr) // _ALIGN

    def offset_in_place(self, tensor: torch.Tensor, dtype: torch.dtype) -> int | None:
        """``offset_of(tensor)`` if the graphs can read ``tensor`` in place as ``dtype`` rows
        (``aligned``), else None."""
        return self.offset_of(tensor) if aligned(tensor, dtype) else None

    def write(self, *values: int) -> None:
        """The next replay's values (at most ``size``; the rest keep theirs)."""
        words = self._words
        n = self.size
        if words[n + _ECHO] != words[n + _SEQ] and self._on_cuda:
            # The replay that reads the last values is still queued: the host is a round ahead.
            torch.cuda.synchronize(self.anchor.device)
        for i, value in enumerate(values):
            words[i] = value
        words[n + _SEQ] += 1

    def fetch(self) -> None:
        """Queue the copy of the host's values into ``table`` (the first kernel of a graph)."""
        fetch_words(self.anchor, self.host_offset, self.table)


def fetch_words(anchor: torch.Tensor, host_offset: int, table: torch.Tensor) -> None:
    """``CallerAddresses.fetch``: ``table.numel()`` values and the sequence number from the words
    ``host_offset`` 16-byte units past ``anchor``, the values into ``table``, the echo after them."""
    size = table.numel()
    _fetch_kernel[(1,)](anchor, host_offset, table, SIZE=size, WORDS_P2=triton.next_power_of_2(size + 1))


def aligned(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the graphs can read ``tensor`` in place as ``dtype`` rows: that dtype, contiguous, 16-byte aligned."""
    return tensor.dtype == dtype and tensor.is_contiguous() and tensor.data_ptr() % _ALIGN == 0


def readable(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` if the graphs can read it in place as ``dtype``, else a fresh contiguous copy in
    ``dtype`` (16-byte aligned, as every new allocation is), which the caller holds until the
    replay is queued."""
    if aligned(tensor, dtype):
        return tensor
    return tensor.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def stage_inputs(
    addresses: CallerAddresses, x_CH: torch.Tensor, ids_CK: torch.Tensor, weights_CK: torch.Tensor
) -> None:
    """Copy the forward's x [T, H], int64 ids [T, K] and float32 weights [T, K] (table: T, then their
    offsets) into rows 0..T-1 of the staging; rows T..C-1 get ids -1 (they go nowhere)."""
    capacity, top_k = ids_CK.shape
    row_words = x_CH.shape[1] * x_CH.element_size() // 4
    _stage_kernel[(capacity,)](
        addresses.anchor,
        addresses.table,
        x_CH.view(torch.int32),
        ids_CK,
        weights_CK,
        ROW_WORDS=row_words,
        TOP_K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        BLOCK_W=min(1024, triton.next_power_of_2(row_words)),
    )


if HAS_TRITON:
    # host_offset is never specialised (a constexpr 1 would have no dtype) and widened before the
    # multiply: Triton passes an offset below 2**31 as int32, where * 16 would wrap.
    @triton.jit(do_not_specialize=["host_offset"])
    def _fetch_kernel(anchor_ptr, host_offset, table_ptr, SIZE: tl.constexpr, WORDS_P2: tl.constexpr):
        host = (anchor_ptr + host_offset.to(tl.int64) * 16).to(tl.pointer_type(tl.int64))
        offs = tl.arange(0, WORDS_P2)
        # The values and the sequence number, fetched again from host memory (never a cached line).
        words = tl.load(host + offs, mask=offs <= SIZE, other=0, cache_modifier=".cv")
        tl.store(table_ptr + offs, words, mask=offs < SIZE)
        seq = tl.sum(tl.where(offs == SIZE, words, 0))
        # The echo depends on every word read, so it is stored only once all of them have returned.
        # (Were the sum ever -1, the echo would be wrong and the host would only synchronise.)
        tl.store(host + SIZE + 1, tl.where(tl.sum(words) == -1, seq - 1, seq))

    @triton.jit
    def _stage_kernel(
        anchor_ptr,
        table_ptr,
        x_dst_ptr,
        ids_dst_ptr,
        w_dst_ptr,
        ROW_WORDS: tl.constexpr,
        TOP_K: tl.constexpr,
        K_P2: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        c = tl.program_id(0)
        offs_k = tl.arange(0, K_P2)
        k_mask = offs_k < TOP_K
        if c < tl.load(table_ptr):
            x_src = (anchor_ptr + tl.load(table_ptr + 1) * 16).to(tl.pointer_type(tl.int32))
            ids_src = (anchor_ptr + tl.load(table_ptr + 2) * 16).to(tl.pointer_type(tl.int64))
            w_src = (anchor_ptr + tl.load(table_ptr + 3) * 16).to(tl.pointer_type(tl.float32))
            row = c.to(tl.int64) * ROW_WORDS
            for w0 in range(0, ROW_WORDS, BLOCK_W):
                w = w0 + tl.arange(0, BLOCK_W)
                tl.store(x_dst_ptr + row + w, tl.load(x_src + row + w, mask=w < ROW_WORDS), mask=w < ROW_WORDS)
            tl.store(ids_dst_ptr + c * TOP_K + offs_k, tl.load(ids_src + c * TOP_K + offs_k, mask=k_mask), mask=k_mask)
            tl.store(w_dst_ptr + c * TOP_K + offs_k, tl.load(w_src + c * TOP_K + offs_k, mask=k_mask), mask=k_mask)
        else:
            tl.store(ids_dst_ptr + c * TOP_K + offs_k, tl.full([K_P2], -1, tl.int64), mask=k_mask)
