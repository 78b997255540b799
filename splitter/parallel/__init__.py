"""Parallel mode: operator sharding (tensor parallelism) over groups of workers."""
