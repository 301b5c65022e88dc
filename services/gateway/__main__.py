"""python -m services.gateway [--cluster FILE]: the OpenAI endpoint (uvicorn + uvloop)."""

from __future__ import annotations

import asyncio
import sys

from uvicorn.config import STARTUP_FAILURE

from shared.config import ConfigError, load_cluster
from shared.logging import configure_logging
from shared.runtime import pin_cpus, service_parser


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("gateway", "Serve the OpenAI API.")
    parser.add_argument("--gateway-id", help="unique gateway id (default gw-host-pid)")
    args = parser.parse_args(argv)
    log = configure_logging("gateway")
    from services.gateway.config import GatewayServiceConfig

    try:
        cluster = load_cluster(args.cluster)
        cfg = GatewayServiceConfig.from_cluster(cluster, args.gateway_id)
        pin_cpus(cluster.service_cpus("gateway"), "[gateway]")
    except ConfigError as exc:
        log.error("bad_config", error=str(exc))
        return 2
    from services.gateway.app import create_app
    from services.gateway.server import GatewayServer, server_config

    app = create_app(cfg, freeze_heap_when_started=True)
    log.info("gateway_listening", url=f"http://{cluster.gateway.host}:{cluster.gateway.port}/v1")
    server = GatewayServer(server_config(app, cluster.gateway))
    try:
        server.run()
    except asyncio.CancelledError:  # a signal while starting (GatewayServer)
        log.info("gateway_stopped_while_starting")
        return 0
    # uvicorn (>= 0.53) exits with STARTUP_FAILURE itself when it cannot bind or the
    # start-up fails, having logged why; this covers a server stopped before it started
    return 0 if server.started else STARTUP_FAILURE


if __name__ == "__main__":
    sys.exit(main())
