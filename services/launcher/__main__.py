"""python -m services.launcher [cluster.toml]: run NATS, Redis and every Baton service locally."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.config import DEFAULT_CLUSTER_FILE, ConfigError, Env, load_cluster
from shared.runtime import check_cpus


def main(argv: list[str] | None = None) -> int:
    env_help = "\n".join(f"  {v.name:<20} {v.help}" for v in Env.all())
    parser = argparse.ArgumentParser(
        prog="python -m services.launcher",
        description="Start Redis and NATS (when none is reachable; a namespace with live workers "
        "is refused), then the estimator, the relay and batcher (when a preset routes per token), "
        "one worker per model instance and the gateway; serve the OpenAI API once every worker "
        "is ready; restart a service that dies; stop everything on Ctrl-C.",
        epilog=f"environment variables:\n{env_help}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "cluster",
        nargs="?",
        help=f"cluster file (default $BATON_CLUSTER or {DEFAULT_CLUSTER_FILE})",
    )
    parser.add_argument(
        "--log-dir", default=None, help="per-service logs (default $BATON_LOG_DIR or logs/)"
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every worker to load (default 600); then it serves what is "
        "ready, or stops if no worker is",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="restarts of one service within a minute before a further exit stops everything "
        "(default 5; 0: the first exit of any service stops everything)",
    )
    args = parser.parse_args(argv)
    if args.max_restarts is not None and args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    path = Path(args.cluster or Env.CLUSTER.get() or DEFAULT_CLUSTER_FILE)
    try:
        cluster = load_cluster(path)
        for where, cpus in cluster.cpu_settings():  # refused here, before anything starts
            check_cpus(cpus, where)
        if not any(inst.replicas for inst in cluster.instances):
            # (the launcher would wait its whole ready timeout for no worker)
            raise ConfigError(
                f"{path} starts no worker: add an [[instances]] entry with replicas >= 1"
            )
    except ConfigError as exc:
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    from services.launcher.children import DEFAULT_MAX_RESTARTS
    from services.launcher.launcher import Launcher

    log_dir = Path(args.log_dir or Env.LOG_DIR.get() or "logs")
    return Launcher(
        cluster,
        path.resolve(),
        log_dir.resolve(),
        ready_timeout_s=args.ready_timeout,
        max_restarts=DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts,
    ).run()


if __name__ == "__main__":
    sys.exit(main())
