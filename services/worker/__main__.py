"""python -m services.worker --model NAME [--cluster FILE] [--instance-id ID]"""

from __future__ import annotations

import os
import sys

from shared.config import ConfigError, Env, load_cluster
from shared.logging import configure_logging
from shared.runtime import pin_cpus, run_service, service_parser


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("worker", "Run one model instance.")
    parser.add_argument("--model", help="model to serve (default $BATON_MODEL)")
    parser.add_argument("--instance-id", help="unique instance id (default model-host-pid)")
    args = parser.parse_args(argv)
    log = configure_logging("worker")
    try:
        cluster = load_cluster(args.cluster)
        model = args.model or Env.MODEL.get()
        if not model:
            raise ConfigError("no model given: pass --model or set BATON_MODEL")
        instance = cluster.instance_for(model)
        os.environ.setdefault("OMP_NUM_THREADS", str(instance.threads))
        # before torch loads: its threads then start on these CPUs
        pin_cpus(instance.cpus, f"[[instances]] of {model!r}")
        from services.worker.config import WorkerServiceConfig
        from services.worker.service import WorkerService

        cfg = WorkerServiceConfig.from_cluster(cluster, model, args.instance_id)
    except ConfigError as exc:
        log.error("bad_config", error=str(exc))
        return 2
    if cfg.model_config.engine == "torch":  # sim workers never import torch
        import torch

        torch.set_num_threads(cfg.instance.threads)
    # The step thread holds the GIL between kernels; a short switch interval lets
    # the event loop take inbox messages and flush deltas during a step.
    sys.setswitchinterval(0.001)
    service = WorkerService(cfg)

    return run_service(service, "worker", ready=service.started)


if __name__ == "__main__":
    sys.exit(main())
