"""Each policy's route on hand-made RouteBatches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.worker.routing.api import STAY, hand_after, hand_rewrite
from services.worker.routing.policies import TOKEN_POLICIES, create_token_policy
from services.worker.routing.policies.me import MEPolicy
from tests.services.worker.routing.conftest import LARGE, SMALL, VOCAB, hidden_rows, route_batch

PAIR = [SMALL, LARGE]
TRIO = [SMALL, "smollm2-medium", LARGE]


def test_registry_names() -> None:
    assert set(TOKEN_POLICIES) == {"r2r", "citer", "co-llm", "r-stitch", "me"}
    for name, cls in TOKEN_POLICIES.items():
        assert cls.name == name


def test_unknown_policy_and_bad_index(artifacts: Path) -> None:
    with pytest.raises(ValueError, match="unknown token policy"):
        create_token_policy("nope", PAIR, 0, {}, artifacts)
    with pytest.raises(ValueError, match="model_index"):
        create_token_policy("r2r", PAIR, 2, {}, artifacts)
    with pytest.raises(ValueError, match="needs 2-2 models"):
        create_token_policy("r2r", TRIO, 0, {}, artifacts)


@pytest.mark.parametrize("name", ["r2r", "co-llm"])
def test_small_side_rewrites_when_router_fires(artifacts: Path, name: str) -> None:
    # The tiny routers output sigmoid(10 * hidden[0]); default threshold 0.5.
    policy = create_token_policy(name, PAIR, 0, {}, artifacts)
    batch = route_batch(hidden_rows([1.0, -1.0, 0.5, -0.5]))
    assert policy.route(batch) == [hand_rewrite(1), STAY, hand_rewrite(1), STAY]


def test_citer_routes_low_confidence(artifacts: Path) -> None:
    policy = create_token_policy("citer", PAIR, 0, {}, artifacts)
    batch = route_batch(hidden_rows([1.0, -1.0, 0.5, -0.5]))
    assert policy.route(batch) == [STAY, hand_rewrite(1), STAY, hand_rewrite(1)]


@pytest.mark.parametrize(
    ("name", "arg"), [("r2r", "threshold"), ("citer", "tau"), ("co-llm", "eta")]
)
def test_threshold_arg_overrides_default(artifacts: Path, name: str, arg: str) -> None:
    # hidden[0] = 0.2 -> p = sigmoid(2) = 0.881: above the default 0.5, below 0.95.
    batch = route_batch(hidden_rows([0.2]))
    default = create_token_policy(name, PAIR, 0, {}, artifacts).route(batch)
    override = create_token_policy(name, PAIR, 0, {arg: 0.95}, artifacts).route(batch)
    assert default != override
    assert create_token_policy(name, PAIR, 0, {arg: "0.95"}, artifacts).route(batch) == override


@pytest.mark.parametrize("name", ["r2r", "citer", "co-llm"])
def test_large_side_hands_back_after_every_token(artifacts: Path, name: str) -> None:
    (artifacts / f"{name}.safetensors").unlink()  # the large side never loads the router
    policy = create_token_policy(name, PAIR, 1, {}, artifacts)
    batch = route_batch(hidden_rows([1.0, -1.0, 0.0]), model_index=1)
    assert policy.route(batch) == [hand_after(0)] * 3


@pytest.mark.parametrize("name", ["r2r", "citer", "co-llm"])
def test_router_of_another_small_model_is_refused(artifacts: Path, name: str) -> None:
    with pytest.raises(ValueError, match="trained on 'smollm2-small'"):
        create_token_policy(name, ["smollm2-medium", LARGE], 0, {}, artifacts)


def test_bad_arguments_are_refused(artifacts: Path) -> None:
    with pytest.raises(ValueError, match="takes no argument 'tau'"):
        create_token_policy("r2r", PAIR, 0, {"tau": 0.3}, artifacts)
    with pytest.raises(ValueError, match="must be a number"):
        create_token_policy("citer", PAIR, 0, {"tau": "high"}, artifacts)
    with pytest.raises(ValueError, match=r"must be in \[0.0, 1.0\]"):
        create_token_policy("co-llm", PAIR, 0, {"eta": 1.5}, artifacts)


def test_missing_router_file_says_how_to_build_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="just routers"):
        create_token_policy("r2r", PAIR, 0, {}, tmp_path)


def test_hidden_size_mismatch_is_an_error(artifacts: Path) -> None:
    policy = create_token_policy("r2r", PAIR, 0, {}, artifacts)
    with pytest.raises(ValueError, match="hidden size"):
        policy.route(route_batch(torch.zeros(2, 16)))


def peaked(n: int) -> torch.Tensor:
    """Logits with almost all mass on token 3 (normalized entropy ~0)."""
    logits = torch.full((n, VOCAB), -30.0)
    logits[:, 3] = 30.0
    return logits


def test_r_stitch_switches_both_ways_on_entropy(artifacts: Path) -> None:
    flat = torch.zeros(1, VOCAB)  # normalized entropy 1
    logits = torch.cat([flat, peaked(1)])
    hidden = torch.zeros(2, 8)
    small = create_token_policy("r-stitch", PAIR, 0, {}, artifacts)
    assert small.route(route_batch(hidden, logits)) == [hand_rewrite(1), STAY]
    large = create_token_policy("r-stitch", PAIR, 1, {}, artifacts)
    assert large.route(route_batch(hidden, logits, model_index=1)) == [STAY, hand_after(0)]


def test_r_stitch_tau_from_args(artifacts: Path) -> None:
    # Two equally likely tokens: normalized entropy log 2 / log 50 = 0.177.
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, :2] = 0.0
    batch = route_batch(torch.zeros(1, 8), logits)
    assert create_token_policy("r-stitch", PAIR, 0, {}, artifacts).route(batch) == [STAY]
    routed = create_token_policy("r-stitch", PAIR, 0, {"tau": 0.1}, artifacts).route(batch)
    assert routed == [hand_rewrite(1)]


def confident_logits(n: int, confidence: float) -> torch.Tensor:
    """Logits whose argmax (token 0) has probability `confidence` at temperature 1."""
    rest = (1.0 - confidence) / (VOCAB - 1)
    probs = torch.full((n, VOCAB), rest)
    probs[:, 0] = confidence
    return probs.log()


def test_me_writer_shares_follow_weights_and_confidence(artifacts: Path) -> None:
    n = 6000
    for index, conf in ((0, 0.6), (2, 0.3)):
        policy = create_token_policy("me", TRIO, index, {}, artifacts)
        assert isinstance(policy, MEPolicy)
        batch = route_batch(torch.zeros(n, 8), confident_logits(n, conf), model_index=index)
        dest = policy.route(batch)
        shares = [sum(1 for d in dest if (d - 1 if d else index) == j) / n for j in range(3)]
        w = torch.tensor([0.5, 0.3, 0.2])
        evidence = torch.full((3,), 1.0 - conf)
        evidence[index] = conf
        expected = (w * evidence / (w * evidence).sum()).tolist()
        assert shares == pytest.approx(expected, abs=0.025)
        assert all(d >= 0 for d in dest)  # the sampled token always stands


def test_me_weights_from_args_and_zero_weight(artifacts: Path) -> None:
    batch = route_batch(torch.zeros(500, 8), confident_logits(500, 0.2))
    policy = create_token_policy("me", TRIO, 0, {"weights": "1,0,1"}, artifacts)
    dest = policy.route(batch)
    assert hand_after(1) not in dest
    assert {STAY, hand_after(2)} <= set(dest)


def test_me_confident_model_keeps_the_pen(artifacts: Path) -> None:
    batch = route_batch(torch.zeros(200, 8), peaked(200), model_index=1)
    policy = create_token_policy("me", TRIO, 1, {}, artifacts)
    assert policy.route(batch) == [STAY] * 200


def test_me_draws_by_the_request_key_not_its_id(artifacts: Path) -> None:
    """Rows with one draw key (requests with the same seed, or greedy on the same
    prompt) are routed alike whatever their ids; rows without one draw by their ids."""
    policy = create_token_policy("me", TRIO, 0, {}, artifacts)
    by_id = route_batch(torch.zeros(300, 8), confident_logits(300, 0.5))
    assert len(set(policy.route(by_id))) > 1  # 300 ids: draws that differ
    for prefix in ("r", "x"):
        keyed = route_batch(torch.zeros(300, 8), confident_logits(300, 0.5), prefix=prefix)
        for state in keyed.states:
            state.draw_key = "seed:7"
        routes = policy.route(keyed)
        assert len(set(routes)) == 1  # one key, one position, one confidence: one draw
        if prefix == "r":
            first = routes
        else:
            assert routes == first


def test_me_is_deterministic_under_its_seed(artifacts: Path) -> None:
    batch = route_batch(torch.zeros(300, 8), confident_logits(300, 0.5))
    first = create_token_policy("me", TRIO, 0, {"seed": 7}, artifacts).route(batch)
    again = create_token_policy("me", TRIO, 0, {"seed": 7}, artifacts).route(batch)
    other = create_token_policy("me", TRIO, 0, {"seed": 8}, artifacts).route(batch)
    assert first == again
    assert first != other
    # A row's decision does not depend on the rest of the batch.
    single = route_batch(torch.zeros(1, 8), confident_logits(1, 0.5), prefix="r")
    assert create_token_policy("me", TRIO, 0, {"seed": 7}, artifacts).route(single) == first[:1]


def test_me_two_models_and_bad_weights(artifacts: Path) -> None:
    policy = create_token_policy("me", PAIR, 0, {}, artifacts)
    assert isinstance(policy, MEPolicy)
    assert policy.weights.tolist() == pytest.approx([0.625, 0.375])
    with pytest.raises(ValueError, match="3 non-negative numbers"):
        create_token_policy("me", TRIO, 0, {"weights": "0.5,0.5"}, artifacts)
    with pytest.raises(ValueError, match="comma-separated"):
        create_token_policy("me", TRIO, 0, {"weights": "a,b,c"}, artifacts)


def test_stale_router_is_refused(artifacts: Path) -> None:
    from shared.model_store import model_digest

    info = artifacts / "r2r.json"
    meta = json.loads(info.read_text())
    meta["small_model_digest"] = model_digest(SMALL)
    info.write_text(json.dumps(meta))
    create_token_policy("r2r", PAIR, 0, {}, artifacts)
    meta["small_model_digest"] = "sha256:other-weights"
    info.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="retrain"):
        create_token_policy("r2r", PAIR, 0, {}, artifacts)
    create_token_policy("r2r", PAIR, 1, {}, artifacts)  # the large side reads no weights


def test_r_stitch_entropy_is_finite_with_a_trimmed_vocabulary() -> None:
    """A trimmed-head student gives -inf logits outside its kept ids: the entropy must
    stay a number (0 * -inf would be nan and route nothing)."""
    import torch

    from services.worker.routing.policies.r_stitch import normalized_entropy

    logits = torch.zeros(2, 8)
    logits[:, 4:] = float("-inf")
    h = normalized_entropy(logits)
    assert torch.isfinite(h).all()
    assert torch.allclose(
        h,
        torch.full((2,), torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(8.0)).item()),
    )
