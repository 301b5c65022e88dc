"""Cluster-file text for the tests that start a deployment of their own: the tables
they share, written from Python values, so a test states only what it varies."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence

from services.launcher.servers import free_port

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def toml_value(value: object) -> str:
    """A TOML literal: bool, number, string, list or inline table."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: the same escapes
    if isinstance(value, Mapping):
        pairs = ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return f"{{ {pairs} }}"
    if isinstance(value, Sequence):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML literal for {value!r}")


def settings(values: Mapping[str, object]) -> str:
    return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in values.items())


def table(name: str, **values: object) -> str:
    """`[name]` and its settings, then a blank line."""
    return f"\n[{name}]\n{settings(values)}"


def servers(nats_url: str, redis_url: str) -> str:
    """The top-level keys: a namespace of its own, and the test's servers."""
    return settings(
        {"namespace": f"t{uuid.uuid4().hex[:8]}", "nats_url": nats_url, "redis_url": redis_url}
    )


def sim_model(name: str, coefs: Sequence[float], output_len_mean: float, **model: object) -> str:
    """A sim model on the wall clock (six-term batch times `coefs`, every answer
    `output_len_mean` tokens), with random-tiny's tokenizer unless `model` names one."""
    model = {"tokenizer": "random-tiny", **model}
    return table(
        f"models.{toml_key(name)}",
        engine="sim",
        batch_time_features="six-term",
        batch_time_coefs=list(coefs),
        **model,
    ) + table(
        f"models.{toml_key(name)}.sim",
        clock="wall",
        output_len_dist="fixed",
        output_len_mean=output_len_mean,
    )


def instance(model: str, scheduler: Mapping[str, int] | None = None, **values: object) -> str:
    """One `[[instances]]` entry, with its `[instances.scheduler]` limits if given."""
    text = f"\n[[instances]]\n{settings({'model': model, **values})}"
    return text + (table("instances.scheduler", **scheduler) if scheduler else "")


def preset(name: str, models: Sequence[str], **values: object) -> str:
    return table(f"presets.{toml_key(name)}", models=list(models), **values)


def decisions_head(nats_url: str, redis_url: str, **estimator: object) -> str:
    """The top of a cluster file whose tests check the estimator's decisions: a reply
    slowed by a loaded machine must not turn one into the gateway's fallback (a long
    route timeout), and the registry is read every 0.2 s."""
    return (
        servers(nats_url, redis_url)
        + table(
            "gateway",
            port=free_port(),
            registry_refresh_s=0.2,
            event_timeout_s=60.0,
            route_timeout_s=10.0,
        )
        + table("estimator", registry_refresh_s=0.2, **estimator)
        + table("worker", heartbeat_interval_s=0.2, heartbeat_ttl_s=2.0, drain_timeout_s=3.0)
    )


def shipped(text: str, nats_url: str, redis_url: str) -> str:
    """A cluster file from configs/ on the test's servers, with a namespace and a
    gateway port of its own."""
    text = re.sub(r'^namespace = ".*"$', f'namespace = "t{uuid.uuid4().hex[:8]}"', text, flags=re.M)
    text = re.sub(r'^nats_url = ".*"$', f'nats_url = "{nats_url}"', text, flags=re.M)
    text = re.sub(r'^redis_url = ".*"$', f'redis_url = "{redis_url}"', text, flags=re.M)
    return re.sub(r"^port = \d+$", f"port = {free_port()}", text, flags=re.M)
