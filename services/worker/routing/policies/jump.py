"""The one-token jump shared by R2R, CITER and Co-LLM.

Two models, the small one first (the entry). On the small model a learned
router scores every sampled token; an uncertain token is taken back and the
large model rewrites it (hand_rewrite(1)). The large model writes that one token
and hands the pen straight back (hand_after(0) after every token it samples).
Only the small side loads the router.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch

from services.worker.routing.api import STAY, RouteBatch, TokenPolicy, hand_after, hand_rewrite
from services.worker.routing.policies.routers import RouterNet, load_router, load_router_meta
from services.worker.routing.policy_args import check_keys, float_arg
from shared.model_store import model_digest

SMALL, LARGE = 0, 1  # indices in the preset's `models`


class OneTokenJumpPolicy(TokenPolicy):
    """Base class: the small model asks a router; the large one writes one token."""

    threshold_arg: ClassVar[str]  # the preset argument that overrides the calibrated threshold

    def configure(self) -> None:
        check_keys(self.name, self.args, (self.threshold_arg,))
        meta = load_router_meta(self.artifacts_dir, self.name)
        if self.models[SMALL] != meta["small_model"]:
            raise ValueError(
                f"policy {self.name!r}: the router in {self.artifacts_dir} was trained on "
                f"{meta['small_model']!r}, which must be the preset's first model "
                f"(got {self.models[SMALL]!r})"
            )
        trained_on = meta.get("small_model_digest")
        if (
            trained_on is not None
            and self.model_index == SMALL
            and model_digest(self.models[SMALL]) != trained_on
        ):
            raise ValueError(
                f"policy {self.name!r}: the router in {self.artifacts_dir} was trained on other "
                f"weights of {self.models[SMALL]!r}: retrain it with `just routers`"
            )
        self.meta: dict[str, Any] = meta
        self.threshold = float_arg(
            self.name, self.args, self.threshold_arg, float(meta["threshold"]), 0.0, 1.0
        )
        self.net: RouterNet | None = None
        if self.model_index == SMALL:
            self.net, _ = load_router(self.artifacts_dir, self.name)

    def route(self, batch: RouteBatch) -> list[int]:
        if self.model_index != SMALL:
            return [hand_after(SMALL)] * len(batch.states)
        assert self.net is not None
        if batch.hidden.shape[-1] != self.net.spec.hidden_size:
            raise ValueError(
                f"policy {self.name!r}: hidden size {batch.hidden.shape[-1]} does not match "
                f"the router's {self.net.spec.hidden_size}"
            )
        with torch.inference_mode():
            uncertain = self.is_uncertain(batch)
        return [hand_rewrite(LARGE) if u else STAY for u in uncertain.tolist()]

    def probabilities(self, batch: RouteBatch) -> torch.Tensor:
        """[n] the router's output on the small model's rows."""
        assert self.net is not None
        with torch.inference_mode():
            return self.net(batch.hidden, batch.token_ids, batch.logits)

    @abstractmethod
    def is_uncertain(self, batch: RouteBatch) -> torch.Tensor:
        """[n] bool: the large model should rewrite this row's token."""
