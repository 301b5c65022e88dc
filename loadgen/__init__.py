"""loadgen: drive any OpenAI-compatible endpoint with real arrival traces and workloads.

Reports what users measure (TTFT, TPOT, ITL, end-to-end latency, throughput,
goodput, SLO attainment, OnTimeUtility) in `vllm bench serve`-compatible JSON.
Run `python -m loadgen --help`.
"""
