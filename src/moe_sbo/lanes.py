"""Lane counts of Triton kernel axes.

A kernel axis over ``n`` things (ranks, top-k slots, expert groups) is a power of two wide, the lanes
past ``n`` masked. Compiled Triton 3.6 mis-compiled such an axis one lane wide: on an H200,
``low_latency``'s pack pass lost the ids of half its rows at one rank (P = 1), where Triton's CPU
interpreter got them right, and two lanes fixed it. So no axis is narrower than two lanes; the extra
one is masked like any pad (the GPU tests hold the one-rank and top-1 cases to the torch path).
"""

from __future__ import annotations

import triton


def lanes(n: int) -> int:
    """The lanes of a kernel axis over ``n`` things: the next power of two, at least 2."""
    return max(triton.next_power_of_2(max(int(n), 1)), 2)
