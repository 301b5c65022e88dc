"""python -m services.estimator [--cluster FILE]: the query-level router."""

from __future__ import annotations

import sys

from shared.config import ClusterConfig
from shared.runtime import StoppableService, cluster_service_main


def build(cluster: ClusterConfig) -> StoppableService:
    from services.estimator.service import EstimatorService

    return EstimatorService(cluster)


if __name__ == "__main__":
    sys.exit(cluster_service_main("estimator", "Answer routing requests.", build))
