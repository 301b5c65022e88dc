"""python -m services.batcher [--cluster FILE]: the delayed-batching controller."""

from __future__ import annotations

import contextlib
import os
import sys

from shared.config import ClusterConfig
from shared.runtime import StoppableService, cluster_service_main


def build(cluster: ClusterConfig) -> StoppableService:
    from services.batcher.service import BatcherService

    # The chain is CPU-heavy (seconds per recompute) and never on a request's path:
    # the batcher process yields the cores to the workers.
    with contextlib.suppress(OSError):
        os.nice(cluster.batcher.nice)

    return BatcherService(cluster)


if __name__ == "__main__":
    sys.exit(
        cluster_service_main(
            "batcher", "Estimate routing statistics and publish deadlock-free B* tables.", build
        )
    )
