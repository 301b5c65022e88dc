"""python -m services.relay [--cluster FILE]: the token-routing relay."""

from __future__ import annotations

import sys

from shared.config import ClusterConfig
from shared.runtime import StoppableService, cluster_service_main


def build(cluster: ClusterConfig) -> StoppableService:
    from services.relay.service import RelayService

    return RelayService(cluster)


DESCRIPTION = (
    "Move token-level hand-offs (PeerReqs) between workers; hand a request back to its "
    "origin when a peer dies or times out."
)

if __name__ == "__main__":
    sys.exit(cluster_service_main("relay", DESCRIPTION, build))
