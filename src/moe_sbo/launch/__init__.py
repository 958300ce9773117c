"""Starting ranks: local processes on CPU or GPUs (``LocalRanks``, ``RankPool``), or joining a torchrun
job (``init_from_torchrun``). A tool of the CLI and the benchmarks; the core never imports it."""
