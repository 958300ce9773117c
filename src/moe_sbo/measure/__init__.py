"""What benchmarks and the command line share: result files, timing, and profiler traces as timelines."""
