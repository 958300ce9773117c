"""``moe-sbo bench <mode>``'s runners, one module per mode (``sbo``, ``tbo``, ``eplb``, ``foundation``,
``low_latency``, ``prefill``, ``dense_experts``, ``fp8_experts``, ``router``, ``generate``,
``load_memory``), each with ``main(args) -> int``; ``common`` holds what a mode's rank functions
share, ``sweep`` the launching side's steps, checks and wire of ``sbo``, ``tbo`` and ``eplb``,
``ep_sweep`` the options of the EP-size sweeps. The command line (``cli.parsers.bench``) names each
mode's parser and runner and imports the runner only when that mode runs. A tool room: it imports the
core, ``measure``, ``launch``, ``hf`` and ``planner``, never ``cli``; nothing imports it but ``cli``.
"""
