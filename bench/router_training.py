"""Fitting and calibrating the learned routers (used by `scripts/train_routers.py`).

Pure functions over teacher-forced features, so tests can run them on synthetic
data. Objectives:
  * "diverges" (R2R): BCE, target 1 where the small model's argmax differs from
    the large model's;
  * "acceptable" (CITER): BCE, target 1 where they agree;
  * "deferral" (Co-LLM): the latent-variable likelihood of the reference token,
    -log((1 - d) p_small(ref) + d p_large(ref)), d = sigmoid(router logit),
    with both language models frozen.
Model selection keeps the epoch with the lowest validation loss.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from services.worker.routing.policies.routers import RouterNet

OBJECTIVES = ("diverges", "acceptable", "deferral")


@dataclass
class Features:
    """Teacher-forced rows: one per answer position, the small model's view plus labels."""

    hidden: torch.Tensor  # [n, hidden] small model's hidden state (model dtype)
    token_ids: torch.Tensor  # [n] int64 small model's sampled (argmax) token
    topk: torch.Tensor  # [n, k] fp32 top-k log-probabilities of the small model
    diverges: torch.Tensor  # [n] bool small argmax != large argmax
    logp_small: torch.Tensor  # [n] fp32 small model's log-prob of the reference token
    logp_large: torch.Tensor  # [n] fp32 large model's log-prob of the reference token

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def rows(self, idx: torch.Tensor) -> Features:
        return Features(
            self.hidden[idx],
            self.token_ids[idx],
            self.topk[idx],
            self.diverges[idx],
            self.logp_small[idx],
            self.logp_large[idx],
        )


@dataclass(frozen=True)
class FitConfig:
    epochs: int = 8
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 1e-4
    seed: int = 0


@dataclass
class FitResult:
    best_epoch: int
    val_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half)."""
    labels = labels.bool()
    num_pos, num_neg = int(labels.sum()), int((~labels).sum())
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    s = scores.double()
    order = torch.argsort(s)
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, len(s) + 1, dtype=torch.float64)
    # Average ranks within ties.
    uniq, inverse = torch.unique(s, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(s))
    ranks = (sums / counts)[inverse]
    u = float(ranks[labels].sum()) - num_pos * (num_pos + 1) / 2
    return u / (num_pos * num_neg)


def threshold_for_recall(scores: torch.Tensor, positives: torch.Tensor, recall: float) -> float:
    """The largest t with share(scores > t among positives) >= recall (R2R's rule)."""
    pos = torch.sort(scores[positives.bool()].double()).values
    if len(pos) == 0:
        raise ValueError("no positive rows to calibrate a recall on")
    allowed_below = math.floor((1.0 - recall) * len(pos) + 1e-9)  # positives that may miss
    if allowed_below == 0:
        return math.nextafter(float(pos[0]), -math.inf)
    t = float(pos[allowed_below - 1])
    # Ties at t can push positives below; step down until the recall holds.
    while float((scores.double() > t)[positives.bool()].float().mean()) < recall:
        t = math.nextafter(t, -math.inf)
    return t


def threshold_for_share(scores: torch.Tensor, share: float, route_below: bool) -> float:
    """t such that about `share` of rows route: score < t (route_below) or score > t."""
    s = torch.sort(scores.double()).values
    n = len(s)
    k = min(max(round(share * n), 0), n)
    if route_below:
        return float(s[k]) if k < n else math.nextafter(float(s[-1]), math.inf)
    return float(s[n - k - 1]) if k < n else math.nextafter(float(s[0]), -math.inf)


def youden_threshold(scores: torch.Tensor, positives: torch.Tensor) -> float:
    """t maximizing TPR - FPR of the rule score > t (Co-LLM's threshold search)."""
    pos = positives.bool()
    order = torch.argsort(scores.double(), descending=True)
    s, p = scores.double()[order], pos[order].double()
    tpr = torch.cumsum(p, 0) / max(float(p.sum()), 1.0)
    fpr = torch.cumsum(1.0 - p, 0) / max(float((1.0 - p).sum()), 1.0)
    # Only cut between distinct scores: row i's cut routes rows 0..i.
    distinct = torch.ones_like(s, dtype=torch.bool)
    distinct[:-1] = s[:-1] != s[1:]
    j = torch.where(distinct, tpr - fpr, torch.tensor(-2.0, dtype=torch.float64))
    i = int(torch.argmax(j))
    return float(s[i + 1]) if i + 1 < len(s) else math.nextafter(float(s[i]), -math.inf)


def objective_loss(objective: str, logits: torch.Tensor, batch: Features) -> torch.Tensor:
    """Mean loss of one objective on router logits [n]."""
    if objective == "diverges":
        return F.binary_cross_entropy_with_logits(logits, batch.diverges.float())
    if objective == "acceptable":
        return F.binary_cross_entropy_with_logits(logits, (~batch.diverges).float())
    if objective == "deferral":
        mix = torch.stack(
            [F.logsigmoid(-logits) + batch.logp_small, F.logsigmoid(logits) + batch.logp_large]
        )
        return -torch.logsumexp(mix, dim=0).mean()
    raise ValueError(f"unknown objective {objective!r}: use one of {OBJECTIVES}")


class TokenProjection(nn.Module):
    """Token rows of the (frozen) embedding, projected to the router's token width."""

    def __init__(self, embedding: torch.Tensor, token_dim: int) -> None:
        super().__init__()
        self.embedding = embedding  # [vocab, emb] frozen, any dtype
        self.proj = nn.Linear(embedding.shape[1], token_dim, bias=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embedding[token_ids].float())

    def table(self) -> torch.Tensor:
        """[vocab, token_dim] the projected table, rounded through fp16 as it is stored."""
        rows = []
        with torch.no_grad():
            for chunk in self.embedding.split(8192):
                rows.append(self.proj(chunk.float()))
        return torch.cat(rows).to(torch.float16).float()


def router_logits(
    net: RouterNet, rows: Features, projection: TokenProjection | None
) -> torch.Tensor:
    """[n] router logits on cached features (training path: projection, cached top-k)."""
    token_features = projection(rows.token_ids) if projection is not None else None
    return net.score(
        net.features(
            rows.hidden,
            rows.token_ids,
            token_features=token_features,
            topk_features=rows.topk,
        )
    )


def set_standardization(net: RouterNet, train: Features) -> None:
    """Mean and std of the hidden and top-k inputs; the learned token part stays (0, 1)."""
    parts_mean, parts_std = [], []
    spec = net.spec
    if "hidden" in spec.inputs:
        h = train.hidden.float()
        parts_mean.append(h.mean(0))
        parts_std.append(h.std(0))
    if "token" in spec.inputs:
        parts_mean.append(torch.zeros(spec.token_dim))
        parts_std.append(torch.ones(spec.token_dim))
    if "topk" in spec.inputs:
        parts_mean.append(train.topk.float().mean(0))
        parts_std.append(train.topk.float().std(0))
    with torch.no_grad():
        net.feature_mean.copy_(torch.cat(parts_mean))
        net.feature_std.copy_(torch.cat(parts_std).clamp_min(1e-4))


def evaluate_logits(
    net: RouterNet, rows: Features, projection: TokenProjection | None, chunk: int = 4096
) -> torch.Tensor:
    """Router logits for every row, in eval mode, without gradients."""
    net.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(rows), chunk):
            idx = torch.arange(start, min(start + chunk, len(rows)))
            out.append(router_logits(net, rows.rows(idx), projection))
    return torch.cat(out) if out else torch.empty(0)


def fit_router(
    net: RouterNet,
    objective: str,
    train: Features,
    val: Features,
    cfg: FitConfig,
    embedding: torch.Tensor | None = None,
    desc: str = "router",
) -> FitResult:
    """Train net in place (best validation epoch kept); R2R's token table is filled at the end."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}: use one of {OBJECTIVES}")
    torch.manual_seed(cfg.seed)
    projection = None
    if "token" in net.spec.inputs:
        if embedding is None:
            raise ValueError("a router with a token input needs the model's embedding")
        projection = TokenProjection(embedding, net.spec.token_dim)
    set_standardization(net, train)
    params = list(net.mlp.parameters()) + (
        list(projection.parameters()) if projection is not None else []
    )
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    result = FitResult(best_epoch=-1)
    best: tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor] | None] | None = None
    bar = tqdm(range(cfg.epochs), desc=desc, leave=False)
    for epoch in bar:
        # 1. One pass over the shuffled training rows.
        net.train()
        order = torch.randperm(len(train), generator=gen)
        for start in range(0, len(order), cfg.batch_size):
            rows = train.rows(order[start : start + cfg.batch_size])
            loss = objective_loss(objective, router_logits(net, rows, projection), rows)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        # 2. Validation loss; keep the best epoch.
        val_loss = float(objective_loss(objective, evaluate_logits(net, val, projection), val))
        result.val_losses.append(val_loss)
        bar.set_postfix(val_loss=f"{val_loss:.4f}")
        if best is None or val_loss < best[0]:
            proj_state = copy.deepcopy(projection.state_dict()) if projection is not None else None
            best = (val_loss, copy.deepcopy(net.state_dict()), proj_state)
            result.best_epoch = epoch
    assert best is not None
    net.load_state_dict(best[1])
    if projection is not None and best[2] is not None:
        projection.load_state_dict(best[2])
        assert net.token_table is not None
        with torch.no_grad():
            net.token_table.weight.copy_(projection.table())
    net.eval()
    return result


def serving_probabilities(net: RouterNet, rows: Features, chunk: int = 4096) -> torch.Tensor:
    """[n] probabilities through the serving path (token table lookup, no projection)."""
    return torch.sigmoid(evaluate_logits(net, rows, None, chunk))
