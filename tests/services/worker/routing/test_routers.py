"""Router files: save/load round trip, and the committed routers in models/routers/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.worker.routing.policies import DEFAULT_ARTIFACTS_DIR, create_token_policy
from services.worker.routing.policies.routers import (
    RouterNet,
    RouterSpec,
    load_router,
    save_router,
    topk_logprobs,
)
from tests.services.worker.routing.conftest import route_batch


def test_save_load_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    spec = RouterSpec(("hidden", "token", "topk"), 8, (16,), vocab_size=30, token_dim=4, topk=3)
    net = RouterNet(spec).eval()
    save_router(tmp_path, "r2r", net, {"threshold": 0.3})
    loaded, meta = load_router(tmp_path, "r2r")
    assert meta["threshold"] == 0.3
    assert RouterSpec.from_json(meta["spec"]) == spec
    hidden, logits = torch.randn(5, 8), torch.randn(5, 30)
    ids = logits.argmax(-1)
    # The token table is stored in fp16; everything else exactly.
    with torch.no_grad():
        assert net.token_table is not None
        net.token_table.weight.copy_(net.token_table.weight.half().float())
        assert torch.allclose(net(hidden, ids, logits), loaded(hidden, ids, logits), atol=1e-6)


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="subset"):
        RouterSpec(("hidden", "nope"), 8, ())
    with pytest.raises(ValueError, match="order"):
        RouterSpec(("topk", "hidden"), 8, (), topk=2)
    with pytest.raises(ValueError, match="token_dim"):
        RouterSpec(("hidden", "token"), 8, ())


def test_topk_logprobs_are_sorted_log_probabilities() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    top = topk_logprobs(logits, 2)
    expected = torch.log_softmax(logits, -1).sort(descending=True).values[:, :2]
    assert torch.allclose(top, expected)


COMMITTED = ["r2r", "citer", "co-llm"]


@pytest.mark.parametrize("name", COMMITTED)
def test_committed_router_gives_probabilities(name: str) -> None:
    if not (DEFAULT_ARTIFACTS_DIR / f"{name}.json").is_file():
        pytest.skip("models/routers/ not built (just routers)")
    net, meta = load_router(DEFAULT_ARTIFACTS_DIR, name)
    assert 0.0 <= meta["threshold"] <= 1.0
    assert meta["metrics"]["val_auc"] > 0.5
    torch.manual_seed(0)
    n, vocab = 8, 49152
    hidden = torch.randn(n, net.spec.hidden_size).to(torch.bfloat16)
    logits = 5 * torch.randn(n, vocab)
    probs = net(hidden, logits.argmax(-1), logits)
    assert probs.shape == (n,)
    assert bool(((probs >= 0) & (probs <= 1)).all())
    policy = create_token_policy(name, [meta["small_model"], meta["large_model"]], 0, {})
    batch = route_batch(hidden, logits)
    assert set(policy.route(batch)) <= {0, -2}


def test_committed_r_stitch_calibration() -> None:
    path = DEFAULT_ARTIFACTS_DIR / "r-stitch.json"
    if not path.is_file():
        pytest.skip("models/routers/ not built (just routers)")
    meta = json.loads(path.read_text())
    assert 0.0 < meta["threshold"] < 1.0
