"""The BATON_* environment registry, the config error, and the checks of URLs and
names that the cluster file and the environment share."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from shared import subjects


class ConfigError(ValueError):
    """The cluster file or an environment variable is invalid."""


# the schemes the clients take (nats-py; redis-py: unix:// is a socket path)
_URL_SCHEMES = {"nats_url": ("nats", "tls", "ws", "wss"), "redis_url": ("redis", "rediss", "unix")}


def url_refusal(key: str, url: str) -> str | None:
    """Why `url` cannot be the cluster's `key` (nats_url or redis_url), or None."""
    schemes = _URL_SCHEMES[key]
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018  (a port that is no number fails only when read)
    except ValueError as exc:
        return str(exc)
    if parsed.scheme not in schemes:
        return f"use a URL with the scheme {' or '.join(s + '://' for s in schemes)}"
    if parsed.scheme == "unix":  # (redis-py would drop a host part and read the rest)
        if parsed.hostname or not parsed.path.startswith("/"):
            return "a unix:// URL names a socket by its absolute path (unix:///path/to/sock)"
    elif not parsed.hostname:
        return f"no host in it (e.g. {schemes[0]}://127.0.0.1)"
    return None


def shown_url(url: str) -> str:
    """`url` for a message: a password in it written as ***."""
    parsed = urlparse(url)
    if parsed.password is None:
        return url
    return parsed._replace(
        netloc=parsed.netloc.replace(f":{parsed.password}@", ":***@", 1)
    ).geturl()


def require_token(value: str, what: str, why: str) -> str:
    """`value` if it can be one NATS subject token (and Redis key part), else a
    ConfigError naming `what` it is and `why` it must be one."""
    if not subjects.is_token(value):
        raise ConfigError(f"{what} {value!r} may hold only letters, digits, '_' and '-' ({why})")
    return value


# ---------------------------------------------------------------------------
# Environment registry


@dataclass(frozen=True)
class EnvVar:
    """One BATON_* variable: its name, what it does, and how to read it."""

    name: str
    help: str

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        value = (os.environ if environ is None else environ).get(self.name)
        return value if value else None

    def get_int(self, environ: Mapping[str, str] | None = None) -> int | None:
        value = self.get(environ)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{self.name} must be an integer, got {value!r}") from None


class Env:
    """Every environment variable Baton reads. Nothing else calls os.environ for config."""

    CLUSTER = EnvVar("BATON_CLUSTER", "cluster file path (default configs/local.toml)")
    NAMESPACE = EnvVar("BATON_NAMESPACE", "prefix of every NATS subject and Redis key")
    NATS_URL = EnvVar("BATON_NATS_URL", "NATS server URL")
    REDIS_URL = EnvVar("BATON_REDIS_URL", "Redis URL")
    HOST = EnvVar("BATON_HOST", "gateway bind address")
    PORT = EnvVar("BATON_PORT", "gateway HTTP port")
    DTYPE = EnvVar("BATON_DTYPE", "engine dtype for every model: auto | float32 | bfloat16")
    WEIGHT_DTYPE = EnvVar(
        "BATON_WEIGHT_DTYPE", "how every model stores its linear weights: auto | same | float16"
    )
    DEVICE = EnvVar("BATON_DEVICE", "engine device for every model: cpu | cuda")
    THREADS = EnvVar("BATON_THREADS", "torch threads per worker process")
    INSTANCE_ID = EnvVar("BATON_INSTANCE_ID", "worker instance id (default: model-host-pid)")
    LINK_HOST = EnvVar(
        "BATON_LINK_HOST", "where a worker's direct link listens ([worker] link_host; 0.0.0.0: all)"
    )
    MODEL = EnvVar("BATON_MODEL", "model a worker serves (when not given on the command line)")
    GATEWAY_ID = EnvVar("BATON_GATEWAY_ID", "gateway id (default: gw-host-pid)")
    API_KEY = EnvVar(
        "BATON_API_KEY", "gateway: require this bearer token on /v1/* (adds to [gateway] api_keys)"
    )
    LOG_LEVEL = EnvVar("BATON_LOG_LEVEL", "debug | info | warning | error")
    LOG_DIR = EnvVar("BATON_LOG_DIR", "launcher: where per-service logs go (default logs/)")
    CACHE_DIR = EnvVar(
        "BATON_CACHE_DIR",
        "derived artefacts: tokenizers, converted weights, native builds, under DIR/baton/ "
        "(default .cache/)",
    )
    NATIVE = EnvVar(
        "BATON_NATIVE", "0: run the SFS replay kernel as plain Python, not its mypyc build"
    )
    DATA_DIR = EnvVar(
        "BATON_DATA_DIR", "traces and prompt sets of loadgen and the benchmarks (default data/)"
    )

    @classmethod
    def all(cls) -> list[EnvVar]:
        return [v for v in vars(cls).values() if isinstance(v, EnvVar)]
