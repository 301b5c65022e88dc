"""The training code on synthetic features: it learns a separable rule, and the
calibration rules do what they say."""

from __future__ import annotations

import pytest
import torch

from bench import router_training as rt
from services.worker.routing.policies.routers import RouterNet, RouterSpec

VOCAB, HIDDEN = 40, 12


def synthetic(n: int, seed: int) -> rt.Features:
    """The small model diverges when hidden[0] > 0; the large model explains the
    reference better when hidden[1] > 0."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    topk = -torch.rand(n, 4, generator=g).sort(dim=1).values
    better = hidden[:, 1] > 0
    logp_small = torch.where(better, torch.tensor(-6.0), torch.tensor(-1.0))
    logp_large = torch.where(better, torch.tensor(-0.5), torch.tensor(-4.0))
    return rt.Features(
        hidden.to(torch.bfloat16), ids, topk, hidden[:, 0] > 0, logp_small, logp_large
    )


CFG = rt.FitConfig(epochs=4, batch_size=128, lr=3e-3, seed=0)


def test_r2r_router_learns_divergence_and_fills_its_token_table() -> None:
    train, val = synthetic(3000, 0), synthetic(800, 1)
    torch.manual_seed(0)
    spec = RouterSpec(
        ("hidden", "token", "topk"), HIDDEN, (32,), vocab_size=VOCAB, token_dim=4, topk=4
    )
    net = RouterNet(spec)
    embedding = torch.randn(VOCAB, 6)
    result = rt.fit_router(net, "diverges", train, val, CFG, embedding)
    assert 0 <= result.best_epoch < CFG.epochs
    probs = rt.serving_probabilities(net, val)  # through the table, as served
    assert rt.roc_auc(probs, val.diverges) > 0.97
    assert net.token_table is not None
    assert float(net.token_table.weight.detach().abs().sum()) > 0


def test_citer_router_learns_acceptability() -> None:
    train, val = synthetic(3000, 2), synthetic(800, 3)
    torch.manual_seed(0)
    net = RouterNet(RouterSpec(("hidden",), HIDDEN, (32,)))
    rt.fit_router(net, "acceptable", train, val, CFG)
    assert rt.roc_auc(rt.serving_probabilities(net, val), ~val.diverges) > 0.97


def test_co_llm_deferral_learns_where_the_large_model_is_better() -> None:
    train, val = synthetic(3000, 4), synthetic(800, 5)
    torch.manual_seed(0)
    net = RouterNet(RouterSpec(("hidden",), HIDDEN, ()))
    rt.fit_router(net, "deferral", train, val, rt.FitConfig(epochs=6, batch_size=128, lr=3e-2))
    d = rt.serving_probabilities(net, val)
    better = val.logp_large > val.logp_small
    assert rt.roc_auc(d, better) > 0.97
    assert float(d[better].mean()) > 0.7 > 0.3 > float(d[~better].mean())


def test_training_is_seeded() -> None:
    train, val = synthetic(600, 6), synthetic(200, 7)
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        net = RouterNet(RouterSpec(("hidden",), HIDDEN, (8,)))
        rt.fit_router(net, "acceptable", train, val, rt.FitConfig(epochs=2, seed=3))
        outs.append(rt.serving_probabilities(net, val))
    assert torch.equal(outs[0], outs[1])


def test_unknown_objective_and_missing_embedding() -> None:
    train = synthetic(10, 8)
    net = RouterNet(RouterSpec(("hidden",), HIDDEN, ()))
    with pytest.raises(ValueError, match="unknown objective"):
        rt.fit_router(net, "nope", train, train, CFG)
    spec = RouterSpec(("hidden", "token"), HIDDEN, (), vocab_size=VOCAB, token_dim=2)
    with pytest.raises(ValueError, match="embedding"):
        rt.fit_router(RouterNet(spec), "diverges", train, train, CFG)


def test_roc_auc_with_ties() -> None:
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8])
    assert rt.roc_auc(scores, torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert rt.roc_auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.5)


def test_threshold_for_recall_is_the_largest_that_keeps_the_recall() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(1000, generator=g)
    positives = torch.rand(1000, generator=g) < 0.4
    t = rt.threshold_for_recall(scores, positives, 0.95)
    recall = float((scores > t)[positives].float().mean())
    assert recall >= 0.95
    above = scores[positives][scores[positives] > t].min()
    assert float((scores > above)[positives].float().mean()) < 0.95


def test_threshold_for_share_both_directions() -> None:
    scores = torch.arange(100, dtype=torch.float32) / 100
    below = rt.threshold_for_share(scores, 0.3, route_below=True)
    assert float((scores < below).float().mean()) == pytest.approx(0.3)
    above = rt.threshold_for_share(scores, 0.3, route_below=False)
    assert float((scores > above).float().mean()) == pytest.approx(0.3)


def test_youden_threshold_splits_a_separable_set() -> None:
    scores = torch.tensor([0.1, 0.2, 0.3, 0.7, 0.8, 0.9])
    positives = torch.tensor([0, 0, 0, 1, 1, 1]).bool()
    t = rt.youden_threshold(scores, positives)
    assert torch.equal(scores > t, positives)
