"""Baton delta files: a small model stored as a difference over a shared base.

A student model of the SmolLM2 family keeps a subset of the base model's decoder
layers and adds trained deltas on top. Only what differs is stored, so a student
is a few MB next to the base weights it borrows (embedding, tied LM head, the
untouched layer weights).

File layout (safetensors, format ``baton-delta-v1``):

* metadata: ``format`` = ``"baton-delta-v1"``, ``base`` (e.g. ``"smollm2-135m"``),
  ``layers`` = JSON list of base layer indices kept in order (student layer ``j``
  is base layer ``layers[j]``), ``note`` (free-form: how it was trained);
* tensors, named after the *student's* HF Llama parameters:
  ``lora_a.<param>`` ``[r, in]`` and ``lora_b.<param>`` ``[out, r]`` are merged
  as ``W += lora_b @ lora_a`` (any LoRA scaling is already folded into
  ``lora_b``); ``full.<param>`` replaces the base tensor. Anything not named
  stays as in the base;
* optional tensor ``vocab_keep`` (int32 ``[K]``, sorted, unique token ids): a
  trimmed-vocabulary LM head. The student computes logits only for these rows of
  the (tied) head; every other token gets probability 0 (see
  ``CausalLM.set_vocab_keep``). Files without it use the full vocabulary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.worker.engine.model import VOCAB_KEEP_KEY

FORMAT = "baton-delta-v1"
DEFAULT_BASE = "smollm2-135m"

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LORA_A, _LORA_B, _FULL = "lora_a.", "lora_b.", "full."


@dataclass
class DeltaFile:
    """The parsed contents of a delta file."""

    base: str
    layers: list[int]
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    full: dict[str, torch.Tensor] = field(default_factory=dict)
    note: str = ""
    vocab_keep: torch.Tensor | None = None  # int32 [K] kept token ids (trimmed head), or None


def save_delta(
    path: str | Path,
    kept_layers: list[int],
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]],
    full: dict[str, torch.Tensor],
    note: str,
    base: str = DEFAULT_BASE,
    dtype: torch.dtype = torch.bfloat16,
    vocab_keep: torch.Tensor | None = None,
) -> None:
    """Write a delta file.

    Args:
        path: output ``.safetensors`` path (parent directories are created).
        kept_layers: base layer indices kept, in student order.
        lora: student parameter name -> ``(lora_a [r, in], lora_b [out, r])``,
            scaling already folded into ``lora_b``.
        full: student parameter name -> replacement tensor.
        note: free-form description of how the delta was trained.
        base: name of the base model.
        dtype: storage dtype of the tensors (``vocab_keep`` is always int32).
        vocab_keep: token ids the student's LM head keeps (trimmed vocabulary), or
            None for the full vocabulary; stored sorted.
    """
    if overlap := set(lora) & set(full):
        raise ValueError(f"parameters both in lora and full: {sorted(overlap)}")
    tensors: dict[str, torch.Tensor] = {}
    for name, (a, b) in lora.items():
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"bad LoRA shapes for {name}: a {tuple(a.shape)}, b {tuple(b.shape)}")
        tensors[_LORA_A + name] = _store(a, dtype)
        tensors[_LORA_B + name] = _store(b, dtype)
    for name, t in full.items():
        tensors[_FULL + name] = _store(t, dtype)
    if vocab_keep is not None:
        tensors[VOCAB_KEEP_KEY] = _check_vocab_keep(str(path), vocab_keep).sort().values
    metadata = {
        "format": FORMAT,
        "base": base,
        "layers": json.dumps([int(i) for i in kept_layers]),
        "note": note,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)


def read_delta(path: str | Path) -> DeltaFile:
    """Read a delta file; raise ``ValueError`` if it is not ``baton-delta-v1``."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format is {meta.get('format')!r}, expected {FORMAT!r}")
    if "base" not in meta or "layers" not in meta:
        raise ValueError(f"{path}: metadata needs 'base' and 'layers', has {sorted(meta)}")
    try:
        layers = json.loads(meta["layers"])
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: 'layers' is not JSON: {meta['layers']!r}") from e
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        raise ValueError(f"{path}: 'layers' must be a list of ints, got {layers!r}")
    keep = tensors.pop(VOCAB_KEEP_KEY, None)
    delta = _parse_tensors(str(path), meta["base"], layers, tensors, meta.get("note", ""))
    delta.vocab_keep = None if keep is None else _check_vocab_keep(str(path), keep)
    return delta


def _check_vocab_keep(where: str, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` as int32 after checking it is a non-empty 1-D set of non-negative ids."""
    if ids.ndim != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(
            f"{where}: vocab_keep must be a non-empty 1-D integer tensor, got "
            f"{ids.dtype} {tuple(ids.shape)}"
        )
    if int(ids.min()) < 0 or ids.unique().numel() != ids.numel():
        raise ValueError(f"{where}: vocab_keep ids must be unique and non-negative")
    return ids.detach().to("cpu", torch.int32).contiguous()


def _parse_tensors(
    path: str, base: str, layers: list[int], tensors: dict[str, torch.Tensor], note: str
) -> DeltaFile:
    """Split the stored tensors into LoRA pairs and full replacements."""
    delta = DeltaFile(base=base, layers=layers, note=note)
    for key, t in tensors.items():
        if key.startswith(_FULL):
            delta.full[key[len(_FULL) :]] = t
        elif key.startswith(_LORA_A):
            name = key[len(_LORA_A) :]
            if _LORA_B + name not in tensors:
                raise ValueError(f"{path}: {key} has no matching {_LORA_B}{name}")
            delta.lora[name] = (t, tensors[_LORA_B + name])
        elif key.startswith(_LORA_B):
            if _LORA_A + key[len(_LORA_B) :] not in tensors:
                raise ValueError(f"{path}: {key} has no matching {_LORA_A}{key[len(_LORA_B) :]}")
        else:
            raise ValueError(f"{path}: unknown tensor {key!r}")
    return delta


def apply_delta(base_state: dict[str, torch.Tensor], delta: DeltaFile) -> dict[str, torch.Tensor]:
    """Build the student's state dict (HF names) from the base's and a delta.

    Base layer ``delta.layers[j]`` becomes student layer ``j``; all non-layer
    tensors (embedding, final norm, an untied ``lm_head`` if present) are
    carried over. LoRA deltas are merged and replacements applied in fp32; each
    result keeps the dtype of the base tensor it updates. A trimmed head's kept
    ids travel as the int32 entry ``vocab_keep`` (``VOCAB_KEEP_KEY``), which
    ``CausalLM.load_hf_state_dict`` understands (plain HF models do not).

    Raises:
        ValueError: if a kept layer is missing from the base, or a delta names a
            parameter the student does not have, or shapes do not match.
    """
    by_layer = _group_layers(base_state)
    for i in delta.layers:
        if i not in by_layer:
            raise ValueError(f"base has no layer {i} (has {len(by_layer)} layers)")
    student = {k: v for k, v in base_state.items() if not _LAYER_RE.match(k)}
    for j, i in enumerate(delta.layers):
        for suffix, t in by_layer[i].items():
            student[f"model.layers.{j}.{suffix}"] = t
    for name, (a, b) in delta.lora.items():
        w = _require(student, name)
        if (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ValueError(f"{name}: LoRA {b.shape[0]}x{a.shape[1]} != base {tuple(w.shape)}")
        merged = w.float() + b.float() @ a.float()
        student[name] = merged.to(w.dtype)
    for name, t in delta.full.items():
        w = _require(student, name)
        if t.shape != w.shape:
            raise ValueError(f"{name}: replacement {tuple(t.shape)} != base {tuple(w.shape)}")
        student[name] = t.float().to(w.dtype)
    if delta.vocab_keep is not None:
        emb = student.get("model.embed_tokens.weight")
        vocab = emb.shape[0] if emb is not None else None
        if vocab is not None and int(delta.vocab_keep.max()) >= vocab:
            raise ValueError(f"vocab_keep holds ids >= the base's vocabulary ({vocab})")
        student[VOCAB_KEEP_KEY] = delta.vocab_keep.clone()
    return student


def _group_layers(state: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Map base layer index -> {parameter suffix: tensor}."""
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        if m := _LAYER_RE.match(key):
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
    return layers


def _require(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Return ``state[name]`` or raise a ValueError naming the missing parameter."""
    if name not in state:
        raise ValueError(f"delta names {name!r}, which the student does not have")
    return state[name]


def _store(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Detach, move to CPU, cast and make contiguous for safetensors."""
    return t.detach().to("cpu", dtype).contiguous()
