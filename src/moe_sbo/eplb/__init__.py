"""Expert placement for expert-parallel load balancing (EPLB): which logical expert each physical slot
of each rank holds, with redundant replicas of hot experts, and which weights move when the placement
changes (``placement``). Pure torch on the CPU; imports nothing else of the package."""

from .placement import (
    PLACEMENT_POLICIES,
    Placement,
    global_placement,
    hierarchical_placement,
    local_copies,
    moved_experts,
    placement_for,
    trivial_placement,
    zipf_load,
)

__all__ = [
    "PLACEMENT_POLICIES",
    "Placement",
    "global_placement",
    "hierarchical_placement",
    "local_copies",
    "moved_experts",
    "placement_for",
    "trivial_placement",
    "zipf_load",
]
