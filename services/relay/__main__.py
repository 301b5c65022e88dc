"""python -m services.relay [--cluster FILE]: the token-routing relay."""

from __future__ import annotations

import argparse
import sys

from shared.config import ConfigError, load_cluster
from shared.logging import configure_logging
from shared.runtime import run_service


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.relay",
        description="Move token-level hand-offs (PeerReqs) between workers; hand a request "
        "back to its origin when a peer dies or times out.",
    )
    parser.add_argument(
        "--cluster", help="cluster file (default $BATON_CLUSTER or configs/local.toml)"
    )
    args = parser.parse_args(argv)
    log = configure_logging("relay")
    try:
        cluster = load_cluster(args.cluster)
    except ConfigError as exc:
        log.error("bad_config", error=str(exc))
        return 2
    from services.relay.service import RelayService

    return run_service(RelayService(cluster), "relay")


if __name__ == "__main__":
    sys.exit(main())
