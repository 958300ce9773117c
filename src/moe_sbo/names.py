"""The names the string options of the library take: dispatchers, overlap modes, decode loops and
MLA decode steps, as plain tuples.

The hard part is that they must be importable without torch: the command line offers them in its
``--help`` before torch (seconds to import) is loaded. The modules that implement them import their
names from here; the dispatcher registry checks itself against ``DISPATCHER_NAMES`` when it loads.
"""

DISPATCHER_NAMES: tuple[str, ...] = ("allgather", "alltoall", "local", "low_latency")
FIXED_MODES: tuple[str, ...] = ("none", "dispatch", "combine", "combine_sm", "split")
OVERLAP_MODES: tuple[str, ...] = (*FIXED_MODES, "auto")
DECODE_LOOPS: tuple[str, ...] = ("transformers", "static", "cuda_graph")
# The decode steps a loaded MLA model can take (``load_model(absorb_mla=...)``): ``hf/mla.py``'s, or
# ``transformers``' own.
MLA_STEPS: tuple[str, ...] = ("absorbed", "transformers")
