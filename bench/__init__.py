"""Benchmark harnesses behind the scripts: the cluster simulation, the SFS benchmark's
parts (`sfs_*`, `engine_process`, `decision_cost`), the gateway benchmark's stack,
client and statistics (`gateway_*`), router training, shared statistics. Never
imported by a service."""
