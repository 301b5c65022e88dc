"""python -m services.batcher [--cluster FILE]: the delayed-batching controller."""

from __future__ import annotations

import argparse
import sys

from shared.config import ConfigError, load_cluster
from shared.logging import configure_logging
from shared.runtime import run_service


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.batcher",
        description="Estimate routing statistics and publish deadlock-free B* tables.",
    )
    parser.add_argument(
        "--cluster", help="cluster file (default $BATON_CLUSTER or configs/local.toml)"
    )
    args = parser.parse_args(argv)
    log = configure_logging("batcher")
    try:
        cluster = load_cluster(args.cluster)
    except ConfigError as exc:
        log.error("bad_config", error=str(exc))
        return 2
    from services.batcher.service import BatcherService

    return run_service(BatcherService(cluster), "batcher")


if __name__ == "__main__":
    sys.exit(main())
