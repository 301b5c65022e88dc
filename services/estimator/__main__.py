"""python -m services.estimator [--cluster FILE]: the query-level router."""

from __future__ import annotations

import argparse
import sys

from shared.config import ConfigError, load_cluster
from shared.logging import configure_logging
from shared.runtime import run_service


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.estimator", description="Answer routing requests."
    )
    parser.add_argument(
        "--cluster", help="cluster file (default $BATON_CLUSTER or configs/local.toml)"
    )
    args = parser.parse_args(argv)
    log = configure_logging("estimator")
    try:
        cluster = load_cluster(args.cluster)
    except ConfigError as exc:
        log.error("bad_config", error=str(exc))
        return 2
    from services.estimator.service import EstimatorService

    try:
        service = EstimatorService(cluster)
    except ValueError as exc:  # e.g. a policy this estimator does not implement
        log.error("bad_config", error=str(exc))
        return 2

    return run_service(service, "estimator")


if __name__ == "__main__":
    sys.exit(main())
