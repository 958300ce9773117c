"""What the benchmarks and the command line share: result files, timing, profiler traces as
timelines, and a command's run on local ranks (``run``: output files, ranks, the memory check in
``memory``, progress, options, tables)."""
