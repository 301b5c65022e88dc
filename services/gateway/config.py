"""The gateway's configuration: one frozen object built once at start."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from shared import subjects
from shared.config import ClusterConfig, ConfigError, Env, GatewayConfig


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
        if explicit is not None and not subjects.is_token(explicit):
            raise ConfigError(
                f"gateway id {explicit!r} may hold only letters, digits, '_' and '-' "
                "(it names the gateway's NATS inbox and Redis key)"
            )
        # a host name may hold dots: the default is made a token
        gid = explicit or subjects.as_token(f"gw-{socket.gethostname()}-{os.getpid()}")
        return cls(gateway_id=gid, cluster=cluster, settings=cluster.gateway)
