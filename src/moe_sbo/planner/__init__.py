"""Communication-budget planner: model shape + batch + SLO + hardware -> bytes, bandwidth, overlap verdicts.

It starts from the published back-of-envelope decode budget for DeepSeek-V3 (a worked example from a
public analysis of SGLang's overlap with DeepEP) and keeps two things side by side: that example's own
figures, evaluated exactly in its convention (``worked_example``), and what a DeepEP-style all-to-all
really moves per GPU (``bytes``). ``inputs`` holds the units, hardware table and
``PlanInputs`` (with the whole-model ``ModelShapes``); ``links`` the bandwidths a plan predicts with
(datasheet or ``calibrate``d); ``memory`` the weight memory per GPU at given EP sizes, routed experts
in bf16 and fp8; ``verdicts`` the overlap verdicts (none, SBO, TBO), the allgather/alltoall comparison
and the ``Plan``; ``nodes`` flat against node-aware dispatch (crossings per token and times on an
NVLink + NIC pair); ``balance`` the expert load balance per EP size and placement policy (``moe_sbo.eplb``'s
placements, imported when asked). Each module imports only those listed before it: inputs,
worked_example, links, bytes, nodes, memory, verdicts; ``balance`` imports none of them.
Units: ``_B`` bytes, ``_us`` microseconds, ``_GBps`` 1e9 bytes/s.
"""

from .balance import DEFAULT_BALANCE_EP, DEFAULT_REDUNDANT, BalanceRow, LoadBalance, load_balance, nodes_for
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
    DEFAULT_MEMORY_EP,
    ELEMENT_B,
    FANOUT_MODELS,
    HARDWARE,
    PRESET_SHAPES,
    SEED_INPUTS,
    SHARED_EXPERT_EFFICIENCY,
    GQAShapes,
    Hardware,
    MLAShapes,
    ModelShapes,
    PlanInputs,
    get_hardware,
    load_model,
    load_shapes,
    preset_shapes,
    read_hf_config,
    shapes_from_hf,
    validate_inputs,
)
from .links import Calibration, Link, calibrate, datasheet_link, transfer_time_us
from .memory import (
    EXPERT_DTYPES,
    FP8_WEIGHT_BLOCK,
    H200_MEMORY_GB,
    ROUTER_B,
    WeightMemory,
    WeightMemoryRow,
    WeightPart,
    expert_bytes,
    expert_matrix_bytes,
    weight_memory,
)
from .nodes import Crossings, NodeAwareRow, PhaseTimes, compare, crossings
from .verdicts import (
    NodeVerdict,
    OverlapVerdict,
    Plan,
    SchemeComparison,
    SchemeRow,
    SharedExpertEstimate,
    SweepPoint,
    closing_verdict,
    make_plan,
    node_verdict_line,
    node_verdicts,
    overlap_verdicts,
    plan_to_json,
    scheme_comparison,
    shared_expert_time_us,
    sweep_batches,
)
from .worked_example import SEED_GB_B, SEED_KB_B, SEED_MB_B, SEED_PRINTED, SeedFigure, round_sig, seed_figures

__all__ = [
    # balance
    "DEFAULT_BALANCE_EP",
    "DEFAULT_REDUNDANT",
    "BalanceRow",
    "LoadBalance",
    "load_balance",
    "nodes_for",
    # inputs
    "B_PER_US_PER_GBPS",
    "DEFAULT_MEMORY_EP",
    "ELEMENT_B",
    "FANOUT_MODELS",
    "HARDWARE",
    "PRESET_SHAPES",
    "SEED_INPUTS",
    "SHARED_EXPERT_EFFICIENCY",
    "GQAShapes",
    "Hardware",
    "MLAShapes",
    "ModelShapes",
    "PlanInputs",
    "get_hardware",
    "load_model",
    "load_shapes",
    "preset_shapes",
    "read_hf_config",
    "shapes_from_hf",
    "validate_inputs",
    # worked_example
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
    # nodes
    "Crossings",
    "NodeAwareRow",
    "PhaseTimes",
    "compare",
    "crossings",
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
    # memory
    "EXPERT_DTYPES",
    "FP8_WEIGHT_BLOCK",
    "H200_MEMORY_GB",
    "ROUTER_B",
    "WeightMemory",
    "WeightMemoryRow",
    "WeightPart",
    "expert_bytes",
    "expert_matrix_bytes",
    "weight_memory",
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
    "closing_verdict",
    "NodeVerdict",
    "node_verdicts",
    "node_verdict_line",
    "scheme_comparison",
    "shared_expert_time_us",
    "sweep_batches",
]
