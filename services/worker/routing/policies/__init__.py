"""The five token-level routing policies and the factory the runtime builds them with.

    r2r       learned divergence router on the small model; the large one rewrites
    citer     learned confidence router (MLP on the hidden state)
    co-llm    learned deferral score (Co-LLM's latent-variable objective)
    r-stitch  normalized-entropy switching both ways
    me        2-3 models, the next writer drawn by ensemble weights x confidence

Trained routers and calibrated thresholds live in `models/routers/`
(`just routers`); docs/token-routing.md, section "Policies", says how.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from services.worker.routing.api import TokenPolicy
from services.worker.routing.policies.citer import CiterPolicy
from services.worker.routing.policies.co_llm import CoLLMPolicy
from services.worker.routing.policies.me import MEPolicy
from services.worker.routing.policies.r2r import R2RPolicy
from services.worker.routing.policies.r_stitch import RStitchPolicy
from shared.config import TOKEN_POLICY_NAMES

TOKEN_POLICIES: dict[str, type[TokenPolicy]] = {
    p.name: p for p in (R2RPolicy, CiterPolicy, CoLLMPolicy, RStitchPolicy, MEPolicy)
}

# The cluster file's check names the same policies (a test adds its own to both).
assert set(TOKEN_POLICIES) == TOKEN_POLICY_NAMES, (set(TOKEN_POLICIES), TOKEN_POLICY_NAMES)

DEFAULT_ARTIFACTS_DIR = Path(__file__).resolve().parents[4] / "models" / "routers"


def register_token_policy(cls: type[TokenPolicy]) -> None:
    """Make a policy class nameable in cluster files too (tests' own policies)."""
    TOKEN_POLICIES[cls.name] = cls
    TOKEN_POLICY_NAMES.add(cls.name)


def unregister_token_policy(name: str) -> None:
    TOKEN_POLICIES.pop(name, None)
    TOKEN_POLICY_NAMES.discard(name)


def create_token_policy(
    name: str,
    models: list[str],
    model_index: int,
    args: Mapping[str, float | str],
    artifacts_dir: Path = DEFAULT_ARTIFACTS_DIR,
) -> TokenPolicy:
    """Build the policy `name` for the worker serving models[model_index] of a preset."""
    cls = TOKEN_POLICIES.get(name)
    if cls is None:
        raise ValueError(
            f"unknown token policy {name!r}: use one of {', '.join(sorted(TOKEN_POLICIES))}"
        )
    if not 0 <= model_index < len(models):
        raise ValueError(f"model_index {model_index} outside the preset's {len(models)} models")
    return cls(models, model_index, args, artifacts_dir)


__all__ = [
    "DEFAULT_ARTIFACTS_DIR",
    "TOKEN_POLICIES",
    "CiterPolicy",
    "CoLLMPolicy",
    "MEPolicy",
    "R2RPolicy",
    "RStitchPolicy",
    "create_token_policy",
    "register_token_policy",
    "unregister_token_policy",
]
