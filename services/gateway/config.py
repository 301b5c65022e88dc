"""The gateway's configuration: one frozen object built once at start."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from shared import subjects
from shared.config import ClusterConfig, Env, GatewayConfig


@dataclass(frozen=True)
class GatewayServiceConfig:
    gateway_id: str  # a subject token, unique per gateway process
    cluster: ClusterConfig
    settings: GatewayConfig

    @classmethod
    def from_cluster(
        cls, cluster: ClusterConfig, gateway_id: str | None = None
    ) -> GatewayServiceConfig:
        gid = gateway_id or Env.GATEWAY_ID.get() or f"gw-{socket.gethostname()}-{os.getpid()}"
        gid = subjects.as_token(gid)  # a host name may hold dots
        return cls(gateway_id=gid, cluster=cluster, settings=cluster.gateway)
