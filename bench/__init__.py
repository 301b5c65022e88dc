"""Benchmark harnesses: the cluster simulation, SFS evaluation, router training and the
pieces the benchmark scripts share. Never imported by a service."""
