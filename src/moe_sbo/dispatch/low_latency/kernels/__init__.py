"""Fused Triton kernels of the ``low_latency`` dispatcher: five kernels per forward at decode sizes, not
~35 torch ops (plus the two small ones of the id assert), each producing the same bytes and indices as
a chain of torch ops of the reference path (``reference.py``); the last (``gather_sum``) lives in
``dispatch/reduce.py``, which the other dispatchers share.

Legend: see ``moe_sbo/__init__.py``; here R = S * K expert rows (padding included). The wire format is
``wire.RowFormat``'s::

    dispatch  pack_rows      (pack.py) grid C x H/1024: program (c, j) counts, from all T x K ids,
                             the earlier tokens going to each rank (token c's row in that block)
                             and writes slice j of token c's packed row (x, or fp8 x and its
                             scales) into every block it goes to: the local send buffer (NCCL),
                             the receive buffer (one rank) or the peer's receive buffer (symmetric
                             memory); j = 0 also writes the ids and weights, flags ids out of
                             range, and marks row c of every block holding <= c tokens as padding.
              [transport]    NCCL all_to_all_single of the blocks, or nothing: with symmetric
                             memory the blocks were written straight into the peers' buffers.
              expert_layout  (layout.py) grid S x K/128: stable counting sort of the S x K
                             received (slot, k) pairs by local expert (real pairs first),
                             per-expert counts, on the device.
              gather_rows    (layout.py) grid R: copies (dequantises, or keeps e4m3 for FP8
                             experts) real expert row i; rows past the real count return at once,
                             so the padding tail costs a launch, not a copy.
    combine   reduce_pairs   (combine.py) grid S x H/1024: each slot's weighted sum over its local
                             experts' outputs, written into its destination block.
              gather_sum     (``reduce.py``) grid T x H/1024: each token's P returned rows, summed
                             in float32.

The hard part is size: a one-pass send plan and layout count every token (pair) in every program,
quadratic work that is free at decode and slow at prefill. From ``TWO_PASS_MIN_CAPACITY`` tokens per
rank both run as two passes with a prefix sum between them (work linear in T), sharing their tails
with the one-pass kernels; the tests hold both to the torch reference.

The kernels run under ``TRITON_INTERPRET=1`` on CPU tensors too; the tests use that to hold them to
the torch reference without a GPU.
"""

from __future__ import annotations

from .combine import reduce_pairs, restamp_weights, sum_returned
from .layout import KernelLayout, expert_layout, expert_rows, gather_rows
from .pack import pack_rows, pack_rows_checked

# From this capacity (tokens per rank) the send plan and the receiver layout run as two passes (work
# linear in the tokens) instead of one (quadratic, fewer launches).
TWO_PASS_MIN_CAPACITY = 512


def two_pass(capacity: int) -> bool:
    """Whether a dispatcher of ``capacity`` tokens per rank plans sends and lays out rows in two passes."""
    return capacity >= TWO_PASS_MIN_CAPACITY


__all__ = [
    "TWO_PASS_MIN_CAPACITY",
    "KernelLayout",
    "expert_layout",
    "expert_rows",
    "gather_rows",
    "pack_rows",
    "pack_rows_checked",
    "reduce_pairs",
    "restamp_weights",
    "sum_returned",
    "two_pass",
]
