"""``low_latency``'s wire format: the packed dispatch row, whose fp8 part is ``quant/fp8.py``'s
activation format (e4m3 with one float32 scale per token and 128 values).

Legend: see ``moe_sbo/__init__.py``.

One fixed-size block per (rank, peer) and phase, moved by one ``all_to_all_single``
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

The hard part is the row's alignment: each part starts on a 4-byte
boundary so it can be viewed in place as its dtype, and rows are padded to 16 bytes so the kernels'
copies stay 16-byte vectorised (over NVLink a narrower store is several times slower).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...quant.fp8 import FP8_DTYPE, FP8_GROUP, dequantize_fp8, quantize_fp8
from ..records import Traffic

ROW_ALIGN_BYTES = 16  # packed rows are a multiple of this many bytes


# ---- the packed row ----------------------------------------------------------------------------------


def align(nbytes: int, to: int) -> int:
    """``nbytes`` rounded up to a multiple of ``to``."""
    return -(-nbytes // to) * to


@dataclass(frozen=True)
class RowFormat:
    """Byte layout of one dispatch row: x (or fp8 x and its scales), ids, weights.

    Each part starts on a 4-byte boundary so it can be viewed in place as its dtype; rows are padded
    to 16 bytes so copies stay vectorised.
    """

    hidden: int
    top_k: int
    dtype: torch.dtype  # the activation dtype (what the receiver gets back)
    fp8: bool
    scales_offset: int
    ids_offset: int
    weights_offset: int
    row_bytes: int

    @classmethod
    @functools.cache  # asked on every dispatch; a handful of formats per process
    def make(cls, hidden: int, top_k: int, dtype: torch.dtype, fp8: bool) -> RowFormat:
        x_bytes = hidden * (1 if fp8 else dtype.itemsize)
        scales_offset = align(x_bytes, 4)
        ids_offset = scales_offset + (4 * hidden // FP8_GROUP if fp8 else 0)
        weights_offset = ids_offset + 4 * top_k
        return cls(
            hidden,
            top_k,
            dtype,
            fp8,
            scales_offset,
            ids_offset,
            weights_offset,
            align(weights_offset + 4 * top_k, ROW_ALIGN_BYTES),
        )

    def _part(self, rows_XB: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return rows_XB[:, offset : offset + nbytes].view(dtype)

    def ids(self, rows_XB: torch.Tensor) -> torch.Tensor:
        """int32 ``[X, K]`` view of the rows' global expert ids."""
        return self._part(rows_XB, self.ids_offset, 4 * self.top_k, torch.int32)

    def weights(self, rows_XB: torch.Tensor) -> torch.Tensor:
        """float32 ``[X, K]`` view of the rows' top-k weights."""
        return self._part(rows_XB, self.weights_offset, 4 * self.top_k, torch.float32)

    def x(self, rows_XB: torch.Tensor) -> torch.Tensor:
        """``[X, H]`` activations in ``dtype``: a view, or a dequantised copy for fp8."""
        if not self.fp8:
            return self._part(rows_XB, 0, self.hidden * self.dtype.itemsize, self.dtype)
        return dequantize_fp8(*self.x_fp8(rows_XB), self.dtype)

    def x_fp8(self, rows_XB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the rows' e4m3 ``[X, H]`` values and float32 ``[X, H/128]`` scales (fp8 rows only)."""
        scales_XQ = self._part(rows_XB, self.scales_offset, 4 * self.hidden // FP8_GROUP, torch.float32)
        return self._part(rows_XB, 0, self.hidden, FP8_DTYPE), scales_XQ

    def pack(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """uint8 ``[T + 1, B]``: token t in row t, and row T the padding row (x zero, ids -1)."""
        num_tokens = x_TH.shape[0]
        rows = torch.zeros(num_tokens + 1, self.row_bytes, dtype=torch.uint8, device=x_TH.device)
        if self.fp8:
            q_TH, scales_TQ = quantize_fp8(x_TH)
            self._part(rows, 0, self.hidden, FP8_DTYPE)[:num_tokens] = q_TH
            self._part(rows, self.scales_offset, 4 * scales_TQ.shape[1], torch.float32)[:num_tokens] = scales_TQ
        else:
            self._part(rows, 0, self.hidden * self.dtype.itemsize, self.dtype)[:num_tokens] = x_TH
        ids = self.ids(rows)
        ids[:num_tokens] = ids_TK
        ids[num_tokens] = -1
        self.weights(rows)[:num_tokens] = weights_TK
        return rows


def block_traffic(fmt: RowFormat, capacity: int, num_ranks: int, node_size: int) -> tuple[Traffic, Traffic]:
    """The bytes one rank moves per phase -> (dispatch's, combine's): a fixed-size block to each other
    rank whatever the routing, (P - 1) * C * B and (P - 1) * C * H * elem; the blocks to ranks of
    other nodes (all but ``node_size`` ranks) cross nodes."""
    per_rank = capacity * fmt.row_bytes, capacity * fmt.hidden * fmt.dtype.itemsize
    dispatch_bytes, combine_bytes = ((num_ranks - 1) * b for b in per_rank)
    other_nodes = num_ranks - node_size
    return (
        Traffic(
            dispatch_bytes_sent=dispatch_bytes,
            dispatch_bytes_recv=dispatch_bytes,
            dispatch_inter_node_sent=other_nodes * per_rank[0],
        ),
        Traffic(
            combine_bytes_sent=combine_bytes,
            combine_bytes_recv=combine_bytes,
            combine_inter_node_sent=other_nodes * per_rank[1],
        ),
    )
