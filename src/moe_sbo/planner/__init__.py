"""Communication-budget planner: model shape + batch + SLO + hardware -> bytes, bandwidth, overlap verdicts.

It starts from the seed's back-of-envelope decode analysis for DeepSeek-V3 and keeps two things side by
side: the seed's own figures, evaluated exactly in its convention (``seed``), and what a DeepEP-style
all-to-all really moves per GPU (``bytes``). ``inputs`` holds the units, hardware table and
``PlanInputs``; ``links`` the bandwidths a plan predicts with (datasheet or ``calibrate``d);
``verdicts`` the overlap verdicts (none, SBO, TBO), the allgather/alltoall comparison and the ``Plan``.
Each module imports only those listed before it: inputs, seed, links, bytes, verdicts.
Units: ``_B`` bytes, ``_us`` microseconds, ``_GBps`` 1e9 bytes/s.
"""

from .bytes import (
    FP8_SCALE_B,
    FP8_SCALE_BLOCK,
    TOPK_ID_B,
    TOPK_WEIGHT_B,
    ByteModel,
    Fanout,
    RowBytes,
    a2a_time_us,
    byte_model,
    combine_row_bytes,
    dispatch_row_bytes,
    expected_fanout,
    max_destination_ranks,
    node_sizes,
    resolve_fanout,
    simulate_fanout,
)
from .inputs import (
    B_PER_US_PER_GBPS,
    ELEMENT_B,
    FANOUT_MODELS,
    HARDWARE,
    SEED_INPUTS,
    SHARED_EXPERT_EFFICIENCY,
    Hardware,
    PlanInputs,
    get_hardware,
    load_model,
    validate_inputs,
)
from .links import Calibration, Link, calibrate, datasheet_link, transfer_time_us
from .seed import SEED_GB_B, SEED_KB_B, SEED_MB_B, SEED_PRINTED, SeedFigure, round_sig, seed_figures
from .verdicts import (
    OverlapVerdict,
    Plan,
    SchemeComparison,
    SchemeRow,
    SharedExpertEstimate,
    SweepPoint,
    make_plan,
    overlap_verdicts,
    plan_to_json,
    scheme_comparison,
    shared_expert_time_us,
    sweep_batches,
)

__all__ = [
    # inputs
    "B_PER_US_PER_GBPS",
    "ELEMENT_B",
    "FANOUT_MODELS",
    "HARDWARE",
    "SEED_INPUTS",
    "SHARED_EXPERT_EFFICIENCY",
    "Hardware",
    "PlanInputs",
    "get_hardware",
    "load_model",
    "validate_inputs",
    # seed
    "SEED_GB_B",
    "SEED_KB_B",
    "SEED_MB_B",
    "SEED_PRINTED",
    "SeedFigure",
    "round_sig",
    "seed_figures",
    # links
    "Calibration",
    "Link",
    "calibrate",
    "datasheet_link",
    "transfer_time_us",
    # bytes
    "FP8_SCALE_B",
    "FP8_SCALE_BLOCK",
    "TOPK_ID_B",
    "TOPK_WEIGHT_B",
    "ByteModel",
    "Fanout",
    "RowBytes",
    "a2a_time_us",
    "byte_model",
    "combine_row_bytes",
    "dispatch_row_bytes",
    "expected_fanout",
    "max_destination_ranks",
    "node_sizes",
    "resolve_fanout",
    "simulate_fanout",
    # verdicts
    "OverlapVerdict",
    "Plan",
    "SchemeComparison",
    "SchemeRow",
    "SharedExpertEstimate",
    "SweepPoint",
    "make_plan",
    "overlap_verdicts",
    "plan_to_json",
    "scheme_comparison",
    "shared_expert_time_us",
    "sweep_batches",
]
