"""Expert-parallel load balancing (EPLB): which logical expert each physical slot of each rank holds,
with redundant replicas of hot experts (``placement``, packing them onto ranks with ``packing``: on the
CPU); what a balanced layer holds on its device, the load window and the replica table (``runtime``);
and moving expert weights between ranks for a new placement (``transfer``). Imports nothing else of
the package."""

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
from .runtime import EPLBOptions, LoadWindow, ReplicaTable
from .transfer import MoveReport

__all__ = [
    "EPLBOptions",
    "LoadWindow",
    "MoveReport",
    "ReplicaTable",
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
