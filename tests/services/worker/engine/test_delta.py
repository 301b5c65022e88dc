"""Round-trip tests for the baton-delta-v1 format on a tiny random HF-named state dict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.worker.engine.delta import FORMAT, DeltaFile, apply_delta, read_delta, save_delta
from services.worker.engine.model import VOCAB_KEEP_KEY

HIDDEN, INTER, KV, LAYERS, VOCAB = 8, 12, 4, 5, 16


def tiny_base(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random 5-layer Llama-shaped state dict in HF names (tied head: no lm_head)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        "self_attn.k_proj.weight": (KV, HIDDEN),
        "self_attn.v_proj.weight": (KV, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        "mlp.gate_proj.weight": (INTER, HIDDEN),
        "mlp.up_proj.weight": (INTER, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, INTER),
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
    }
    state = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    for i in range(LAYERS):
        for suffix, shape in shapes.items():
            state[f"model.layers.{i}.{suffix}"] = torch.randn(*shape, generator=g)
    state["model.norm.weight"] = torch.randn(HIDDEN, generator=g)
    return state


def test_layer_selection_and_renumbering(tmp_path: Path) -> None:
    base = tiny_base()
    path = tmp_path / "d.safetensors"
    save_delta(path, [0, 3, 4], {}, {}, "no training")
    student = apply_delta(base, read_delta(path))
    layer_keys = {k for k in student if k.startswith("model.layers.")}
    assert {int(k.split(".")[2]) for k in layer_keys} == {0, 1, 2}
    for j, i in enumerate([0, 3, 4]):
        assert torch.equal(
            student[f"model.layers.{j}.mlp.up_proj.weight"],
            base[f"model.layers.{i}.mlp.up_proj.weight"],
        )
    assert torch.equal(student["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert torch.equal(student["model.norm.weight"], base["model.norm.weight"])
    assert len(student) == 2 + 3 * 9


def test_lora_merge_and_full_replacement(tmp_path: Path) -> None:
    base = tiny_base()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, HIDDEN, generator=g), torch.randn(INTER, 2, generator=g)
    norm = torch.randn(HIDDEN, generator=g)
    final = torch.randn(HIDDEN, generator=g)
    path = tmp_path / "d.safetensors"
    save_delta(
        path,
        [1, 2],
        {"model.layers.1.mlp.gate_proj.weight": (a, b)},
        {"model.layers.0.input_layernorm.weight": norm, "model.norm.weight": final},
        "trained",
        dtype=torch.float32,
    )
    delta = read_delta(path)
    assert (delta.base, delta.layers, delta.note) == ("smollm2-135m", [1, 2], "trained")
    student = apply_delta(base, delta)
    expected = base["model.layers.2.mlp.gate_proj.weight"] + b @ a
    torch.testing.assert_close(student["model.layers.1.mlp.gate_proj.weight"], expected)
    assert torch.equal(student["model.layers.0.input_layernorm.weight"], norm)
    assert torch.equal(student["model.norm.weight"], final)
    # untouched parameters stay the base's
    assert torch.equal(
        student["model.layers.0.mlp.gate_proj.weight"], base["model.layers.1.mlp.gate_proj.weight"]
    )


def test_bf16_storage_keeps_base_dtype(tmp_path: Path) -> None:
    base = {k: v.to(torch.bfloat16) for k, v in tiny_base().items()}
    a, b = torch.randn(2, HIDDEN), torch.zeros(HIDDEN, 2)
    path = tmp_path / "d.safetensors"
    save_delta(path, [0], {"model.layers.0.self_attn.q_proj.weight": (a, b)}, {}, "")
    delta = read_delta(path)
    assert delta.lora["model.layers.0.self_attn.q_proj.weight"][0].dtype == torch.bfloat16
    student = apply_delta(base, delta)
    assert student["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(
        student["model.layers.0.self_attn.q_proj.weight"],
        base["model.layers.0.self_attn.q_proj.weight"],
    )


def test_wrong_format_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    save_file(
        {"full.model.norm.weight": torch.ones(HIDDEN)},
        str(path),
        metadata={"format": "something-else", "base": "x", "layers": "[0]"},
    )
    with pytest.raises(ValueError, match="format"):
        read_delta(path)


def test_missing_metadata_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    save_file(
        {"full.model.norm.weight": torch.ones(HIDDEN)}, str(path), metadata={"format": FORMAT}
    )
    with pytest.raises(ValueError, match="layers"):
        read_delta(path)
    save_file({}, str(path), metadata={"format": FORMAT, "base": "x", "layers": json.dumps("0,1")})
    with pytest.raises(ValueError, match="list of ints"):
        read_delta(path)


def test_unpaired_lora_and_unknown_tensors_are_rejected(tmp_path: Path) -> None:
    meta = {"format": FORMAT, "base": "x", "layers": "[0]"}
    path = tmp_path / "bad.safetensors"
    save_file(
        {"lora_a.model.layers.0.mlp.up_proj.weight": torch.ones(2, HIDDEN)},
        str(path),
        metadata=meta,
    )
    with pytest.raises(ValueError, match="no matching"):
        read_delta(path)
    save_file({"model.norm.weight": torch.ones(HIDDEN)}, str(path), metadata=meta)
    with pytest.raises(ValueError, match="unknown tensor"):
        read_delta(path)


def test_apply_rejects_bad_layers_names_and_shapes() -> None:
    base = tiny_base()
    with pytest.raises(ValueError, match="no layer 7"):
        apply_delta(base, DeltaFile("x", [0, 7]))
    with pytest.raises(ValueError, match="does not have"):
        apply_delta(
            base,
            DeltaFile("x", [0], full={"model.layers.1.input_layernorm.weight": torch.ones(HIDDEN)}),
        )
    with pytest.raises(ValueError, match="replacement"):
        apply_delta(base, DeltaFile("x", [0], full={"model.norm.weight": torch.ones(3)}))
    lora = {"model.layers.0.mlp.up_proj.weight": (torch.ones(2, HIDDEN), torch.ones(HIDDEN, 2))}
    with pytest.raises(ValueError, match="LoRA"):
        apply_delta(base, DeltaFile("x", [0], lora=lora))


def test_save_rejects_bad_lora_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bad LoRA shapes"):
        save_delta(
            tmp_path / "d.safetensors", [0], {"w": (torch.ones(2, 3), torch.ones(4, 5))}, {}, ""
        )


def test_vocab_keep_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    keep = torch.tensor([9, 2, 14, 5])
    save_delta(path, [0, 1], {}, {}, "trimmed", vocab_keep=keep)
    delta = read_delta(path)
    assert delta.vocab_keep is not None and delta.vocab_keep.dtype == torch.int32
    assert delta.vocab_keep.tolist() == [2, 5, 9, 14]  # stored sorted
    student = apply_delta(tiny_base(), delta)
    assert student[VOCAB_KEEP_KEY].tolist() == [2, 5, 9, 14]
    assert len(student) == 1 + 2 + 2 * 9


def test_without_vocab_keep_nothing_changes(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    save_delta(path, [0, 1], {}, {}, "full head")
    delta = read_delta(path)
    assert delta.vocab_keep is None
    assert VOCAB_KEEP_KEY not in apply_delta(tiny_base(), delta)


def test_an_old_file_without_vocab_keep_still_loads(tmp_path: Path) -> None:
    # Written the way baton-delta-v1 files were before vocab_keep existed.
    path = tmp_path / "old.safetensors"
    norm = torch.randn(HIDDEN)
    save_file(
        {"full.model.norm.weight": norm},
        str(path),
        metadata={"format": FORMAT, "base": "smollm2-135m", "layers": "[0, 4]", "note": "old"},
    )
    delta = read_delta(path)
    assert (delta.layers, delta.vocab_keep) == ([0, 4], None)
    assert torch.equal(apply_delta(tiny_base(), delta)["model.norm.weight"], norm)


def test_bad_vocab_keep_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    with pytest.raises(ValueError, match="integer"):
        save_delta(path, [0], {}, {}, "", vocab_keep=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="unique"):
        save_delta(path, [0], {}, {}, "", vocab_keep=torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="unique and non-negative"):
        save_delta(path, [0], {}, {}, "", vocab_keep=torch.tensor([-1, 3]))
    save_delta(path, [0], {}, {}, "", vocab_keep=torch.tensor([3, VOCAB]))
    with pytest.raises(ValueError, match="vocabulary"):
        apply_delta(tiny_base(), read_delta(path))
