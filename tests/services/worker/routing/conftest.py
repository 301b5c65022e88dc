"""Builders for routing tests: hand-made RouteBatches and tiny router files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from services.worker.routing.api import RouteBatch, RouteState
from services.worker.routing.policies.routers import RouterNet, RouterSpec, save_router

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

HIDDEN, VOCAB, TOPK, TOKEN_DIM = 8, 50, 5, 4
SMALL, LARGE = "smollm2-small", "smollm2-135m"


def route_batch(
    hidden: torch.Tensor,
    logits: torch.Tensor | None = None,
    model_index: int = 0,
    prefix: str = "r",
) -> RouteBatch:
    """A batch whose row i is request f"{prefix}{i}" with 10 output tokens so far."""
    n = hidden.shape[0]
    if logits is None:
        logits = torch.zeros(n, VOCAB)
    states = [RouteState(f"{prefix}{i}", model_index, 5, num_output_tokens=10) for i in range(n)]
    return RouteBatch(states, logits.argmax(-1), logits.float(), hidden)


def hidden_rows(signs: list[float]) -> torch.Tensor:
    """Rows whose first hidden feature is the given value; the rest zero."""
    h = torch.zeros(len(signs), HIDDEN)
    h[:, 0] = torch.tensor(signs)
    return h


def write_router(directory: Path, name: str, spec: RouterSpec, threshold: float) -> None:
    """A router whose logit is 10 * hidden[0] (standardization off)."""
    net = RouterNet(spec)
    with torch.no_grad():
        for p in net.mlp.parameters():
            p.zero_()
        first = net.mlp[0]
        assert isinstance(first, torch.nn.Linear)
        if spec.widths:  # one ReLU layer: pass +h0 and -h0, then recombine
            first.weight[0, 0], first.weight[1, 0] = 1.0, -1.0
            last = net.mlp[-1]
            assert isinstance(last, torch.nn.Linear)
            last.weight[0, 0], last.weight[0, 1] = 10.0, -10.0
        else:
            first.weight[0, 0] = 10.0
    meta = {"policy": name, "small_model": SMALL, "large_model": LARGE, "threshold": threshold}
    save_router(directory, name, net, meta)


@pytest.fixture()
def artifacts(tmp_path: Path) -> Path:
    """Tiny r2r / citer / co-llm routers and an r-stitch calibration in a temp dir."""
    write_router(
        tmp_path,
        "r2r",
        RouterSpec(
            inputs=("hidden", "token", "topk"),
            hidden_size=HIDDEN,
            widths=(),
            vocab_size=VOCAB,
            token_dim=TOKEN_DIM,
            topk=TOPK,
        ),
        0.5,
    )
    write_router(tmp_path, "citer", RouterSpec(("hidden",), HIDDEN, (4,)), 0.5)
    write_router(tmp_path, "co-llm", RouterSpec(("hidden",), HIDDEN, ()), 0.5)
    (tmp_path / "r-stitch.json").write_text(
        json.dumps({"policy": "r-stitch", "threshold": 0.5, "small_model": SMALL})
    )
    return tmp_path
