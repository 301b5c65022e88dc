"""Reading a preset's policy arguments: numbers with defaults, unknown keys refused."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def check_keys(policy: str, args: Mapping[str, float | str], known: Iterable[str]) -> None:
    """ValueError naming the first argument the policy does not take."""
    allowed = set(known)
    for key in args:
        if key not in allowed:
            raise ValueError(
                f"policy {policy!r} takes no argument {key!r} (known: {', '.join(sorted(allowed))})"
            )


def float_arg(
    policy: str,
    args: Mapping[str, float | str],
    key: str,
    default: float,
    low: float = float("-inf"),
    high: float = float("inf"),
) -> float:
    """args[key] as a float in [low, high], or default when absent."""
    raw = args.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(
            f"policy {policy!r}: argument {key!r} must be a number, got {raw!r}"
        ) from None
    if not low <= value <= high:
        raise ValueError(
            f"policy {policy!r}: argument {key!r} must be in [{low}, {high}], got {value}"
        )
    return value


def floats_arg(
    policy: str, args: Mapping[str, float | str], key: str, default: tuple[float, ...]
) -> tuple[float, ...]:
    """A comma-separated list of floats (a string such as "0.5,0.3,0.2"), or default."""
    raw = args.get(key)
    if raw is None:
        return default
    try:
        return tuple(float(x) for x in str(raw).split(","))
    except ValueError:
        raise ValueError(
            f"policy {policy!r}: argument {key!r} must be comma-separated numbers, got {raw!r}"
        ) from None
