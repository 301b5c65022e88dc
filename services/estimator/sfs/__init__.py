"""SFS (Serving Framework Simulation) core for the estimator: the batch-time fit, the
scheduler replay that predicts TTFT/E2E from a snapshot, the throughput and LPS-queue
baselines, and the routing utilities. Pure: no I/O. The batch-time model itself lives in
shared/scheduling/batch_time.py, since workers and the simulated engine use it too."""
