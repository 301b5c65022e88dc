"""Routing-stats reports of the two-model preset "duo" (small, large), as workers send them."""

from __future__ import annotations

from shared.messages.batcher import RoutingStats


def duo_stats(
    model_index: int, tokens: int, handoffs: int, steps: list[tuple[int, float]], **kw: object
) -> RoutingStats:
    """One window's report of instance w<model_index>: `steps` are (batch size, seconds)."""
    return RoutingStats(
        instance_id=f"w{model_index}",
        preset="duo",
        models=["small", "large"],
        model_index=model_index,
        window_s=1.0,
        num_tokens=tokens,
        num_handoffs=handoffs,
        step_batch_sizes=[b for b, _ in steps],
        step_seconds=[t for _, t in steps],
        **kw,  # type: ignore[arg-type]
    )
