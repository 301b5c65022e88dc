"""The gateway's configuration: one frozen object built once at start."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from shared import subjects
from shared.config import ClusterConfig, Env, GatewayConfig, require_token


@dataclass(frozen=True)
class GatewayServiceConfig:
    gateway_id: str  # a subject token, unique per gateway process
    cluster: ClusterConfig
    settings: GatewayConfig

    @classmethod
    def from_cluster(
        cls, cluster: ClusterConfig, gateway_id: str | None = None
    ) -> GatewayServiceConfig:
        explicit = gateway_id or Env.GATEWAY_ID.get()
        why = "it names the gateway's NATS inbox and Redis key"
        # a host name may hold dots: the default is made a token
        gid = (
            require_token(explicit, "gateway id", why)
            if explicit
            else subjects.as_token(f"gw-{socket.gethostname()}-{os.getpid()}")
        )
        return cls(gateway_id=gid, cluster=cluster, settings=cluster.gateway)
