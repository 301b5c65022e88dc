"""The learned token routers (R2R, CITER, Co-LLM): small MLPs over what one forward gives.

A router reads the rows of a RouteBatch as the engine produced them (hidden state
after the final norm in the model's dtype, fp32 logits of the last position, the
sampled token) and returns one logit per row. The same `RouterNet.features` runs
in `scripts/train_routers.py` and at serving time, so training and serving see
identical inputs.

Features (the `inputs` of a RouterSpec, concatenated in this order):
  * "hidden": the hidden state, cast to fp32 [hidden_size];
  * "token": a learned projection of the sampled token's embedding row, stored
    as a table [vocab, token_dim] (R2R's token input without shipping the
    56 MB embedding);
  * "topk": the top-k log-probabilities of the logits at temperature 1, sorted
    descending [topk] (R2R's LM-head logits input, made shift invariant).
Every input is standardized with the training set's mean and std (buffers).

Files: `<dir>/<name>.safetensors` (weights) next to `<dir>/<name>.json`
(spec, threshold, models, metrics).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

INPUTS = ("hidden", "token", "topk")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """Shape of one router network."""

    inputs: tuple[str, ...]  # subset of INPUTS, in INPUTS order
    hidden_size: int  # width of the model's hidden state
    widths: tuple[int, ...]  # hidden layer widths; () = logistic regression
    vocab_size: int = 0  # rows of the token table (inputs has "token")
    token_dim: int = 0  # width of the token table
    topk: int = 0  # top-k log-probabilities (inputs has "topk")
    dropout: float = 0.0  # between hidden layers, training only

    def __post_init__(self) -> None:
        if not self.inputs or any(i not in INPUTS for i in self.inputs):
            raise ValueError(f"router inputs must be a non-empty subset of {INPUTS}")
        if tuple(i for i in INPUTS if i in self.inputs) != tuple(self.inputs):
            raise ValueError(f"router inputs must be in the order {INPUTS}")
        if "token" in self.inputs and (self.vocab_size <= 0 or self.token_dim <= 0):
            raise ValueError("a 'token' input needs vocab_size and token_dim")
        if "topk" in self.inputs and self.topk <= 0:
            raise ValueError("a 'topk' input needs topk > 0")

    @property
    def input_dim(self) -> int:
        dims = {"hidden": self.hidden_size, "token": self.token_dim, "topk": self.topk}
        return sum(dims[i] for i in self.inputs)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RouterSpec:
        raw = dict(raw)
        raw["inputs"] = tuple(raw["inputs"])
        raw["widths"] = tuple(raw["widths"])
        return cls(**raw)


def topk_logprobs(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[n, k] top-k log-probabilities of fp32 logits at temperature 1, descending."""
    top = torch.topk(logits, k, dim=-1, sorted=True).values
    return top - torch.logsumexp(logits, dim=-1, keepdim=True)


class RouterNet(nn.Module):
    """Standardize the features, then an MLP to one logit per row."""

    feature_mean: torch.Tensor  # [input_dim] buffer
    feature_std: torch.Tensor  # [input_dim] buffer

    def __init__(self, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        dim = spec.input_dim
        self.register_buffer("feature_mean", torch.zeros(dim))
        self.register_buffer("feature_std", torch.ones(dim))
        self.token_table = (
            nn.Embedding(spec.vocab_size, spec.token_dim) if "token" in spec.inputs else None
        )
        layers: list[nn.Module] = []
        width_in = dim
        for width in spec.widths:
            layers += [nn.Linear(width_in, width), nn.ReLU()]
            if spec.dropout > 0:
                layers.append(nn.Dropout(spec.dropout))
            width_in = width
        layers.append(nn.Linear(width_in, 1))
        self.mlp = nn.Sequential(*layers)

    def features(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        token_features: torch.Tensor | None = None,
        topk_features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[n, input_dim] raw (unstandardized) features.

        Serving passes token_ids and logits. Training passes token_features (the
        projection being learned, instead of the table) and topk_features
        (`topk_logprobs` of the logits, cached, to avoid keeping [n, vocab]).
        """
        parts = []
        if "hidden" in self.spec.inputs:
            parts.append(hidden.float())
        if "token" in self.spec.inputs:
            if token_features is None:
                assert self.token_table is not None and token_ids is not None
                token_features = self.token_table(token_ids)
            parts.append(token_features.float())
        if "topk" in self.spec.inputs:
            if topk_features is None:
                assert logits is not None, "this router reads the logits"
                topk_features = topk_logprobs(logits.float(), self.spec.topk)
            parts.append(topk_features.float())
        return torch.cat(parts, dim=-1)

    def score(self, features: torch.Tensor) -> torch.Tensor:
        """[n] logits of the router from raw features."""
        x = (features - self.feature_mean) / self.feature_std
        return self.mlp(x).squeeze(-1)

    def forward(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[n] probabilities in [0, 1] (what the router predicts, see the JSON's `predicts`)."""
        return torch.sigmoid(self.score(self.features(hidden, token_ids, logits)))


def save_router(
    directory: Path, name: str, net: RouterNet, meta: dict[str, Any]
) -> tuple[Path, Path]:
    """Write `<name>.safetensors` (the token table in fp16, the rest fp32) and `<name>.json`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for key, t in net.state_dict().items():
        t = t.detach().cpu().contiguous()
        state[key] = t.to(torch.float16) if key.startswith("token_table.") else t.float()
    weights = directory / f"{name}.safetensors"
    save_file(state, str(weights), metadata={"format": "baton-router-v1", "name": name})
    info = directory / f"{name}.json"
    info.write_text(json.dumps({**meta, "spec": net.spec.to_json()}, indent=2) + "\n")
    return weights, info


def load_router_meta(directory: Path, name: str) -> dict[str, Any]:
    """The JSON next to a router (threshold, models, metrics); FileNotFoundError if absent."""
    info = directory / f"{name}.json"
    if not info.is_file():
        raise FileNotFoundError(f"{info} is missing: run `just routers` to train the routers")
    meta: dict[str, Any] = json.loads(info.read_text())
    return meta


def load_router(directory: Path, name: str) -> tuple[RouterNet, dict[str, Any]]:
    """The router network (fp32, eval mode) and its JSON."""
    from safetensors.torch import load_file

    meta = load_router_meta(directory, name)
    weights = directory / f"{name}.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing: run `just routers` to train the routers")
    net = RouterNet(RouterSpec.from_json(meta["spec"]))
    state = {k: v.float() for k, v in load_file(str(weights)).items()}
    net.load_state_dict(state)
    net.eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return net, meta
