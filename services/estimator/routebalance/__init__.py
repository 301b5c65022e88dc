"""RouteBalance: each batch of requests assigned to concrete instances by one score that
prices predicted quality, end-to-end latency on that instance now, and cost, with the
instances' load dead-reckoned inside the batch (load.py, latency.py, score.py,
assign.py)."""
