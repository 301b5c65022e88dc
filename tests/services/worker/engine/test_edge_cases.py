"""Review tests for the serving engine (scheduler, blocks, snapshot, sampler, model,
loader, runner, engine).

Each test pins one edge case down: preemption and resumes in a restored scheduler,
races between adds and steps, seeds, hooks, stop strings across multi-token
characters, RoPE settings in checkpoints, end-of-turn tokens in GGUFs. Tests that
need CUDA are skipped without it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

from services.worker.engine import engine as engine_module  # noqa: E402
from services.worker.engine.attention import rope_inv_freq  # noqa: E402
from services.worker.engine.engine import LLMEngine, RequestError  # noqa: E402
from services.worker.engine.loader import _unpermute_rope, random_config  # noqa: E402
from services.worker.engine.model import CausalLM  # noqa: E402
from services.worker.engine.model_config import ModelConfig  # noqa: E402
from services.worker.engine.sampler import SampleResult, SamplingState, _sample_row, sample  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.scheduling.blocks import blocks_for  # noqa: E402
from shared.scheduling.request import RequestStatus  # noqa: E402
from shared.scheduling.scheduler import ScheduledBatch, Scheduler, SchedulerConfig  # noqa: E402
from shared.scheduling.snapshot import restore_scheduler, take_snapshot  # noqa: E402
from tests.services.worker.engine.builders import engine_config, random_model  # noqa: E402
from tests.shared.scheduling.builders import commit, make_scheduler, step  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---- builders --------------------------------------------------------------------


_TINY: dict[str, CausalLM] = {}


def tiny_model(device: str = "cpu") -> CausalLM:
    """A 2-layer random model (fp32), built once per device."""
    if device not in _TINY:
        _TINY[device] = random_model(3, device)
    return _TINY[device]


def tiny_engine(device: str = "cpu", **limits: int) -> LLMEngine:
    return LLMEngine(engine_config(device, **limits), tiny_model(device))


def drain(engine: LLMEngine, max_steps: int = 2000) -> dict[str, list]:  # type: ignore[type-arg]
    outs: dict[str, list] = {}  # type: ignore[type-arg]
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not drain")


def tokens(outs: list) -> list[int]:  # type: ignore[type-arg]
    return [t for o in outs for t in o.new_token_ids]


def held_blocks(s: Scheduler) -> int:
    return sum(len(r.block_ids) for r in s.requests.values())


def assert_block_invariants(s: Scheduler) -> None:
    held = [b for r in s.requests.values() for b in r.block_ids]
    assert len(held) == len(set(held)), "a block is held twice"
    assert not set(held) & s.blocks.free_block_ids, "a held block is also free (double free)"
    assert len(held) + s.blocks.num_free_blocks == s.config.num_kv_blocks, "leaked blocks"
    for r in s.waiting:
        assert r.block_ids == [] and r.status is RequestStatus.WAITING
    for r in s.running:
        assert len(r.block_ids) >= blocks_for(r.num_computed_tokens, s.config.block_size)


# ---- scheduler, blocks, snapshot ---------------------------------------------------


def test_random_load_keeps_block_accounting_exact() -> None:
    """Aborts in every state, preemption, pending/resume, chunks crossing block
    boundaries: no leak, no double free, every chunk's slots are backed by blocks."""
    for seed in range(60):
        rng = random.Random(seed)
        cfg = SchedulerConfig(
            max_num_seqs=rng.randint(1, 6),
            max_num_batched_tokens=rng.randint(1, 40),
            block_size=rng.choice([1, 2, 4, 8]),
            num_kv_blocks=40,
            max_model_len=rng.choice([16, 32]),
            max_chunk_beside_guests=0,
        )
        s = Scheduler(cfg)
        n = 0
        for _ in range(200):
            if rng.random() < 0.3:
                p = rng.randint(1, cfg.max_model_len - 1)
                s.add(f"r{n}", p, rng.randint(1, cfg.max_model_len - p))
                n += 1
            if rng.random() < 0.05 and s.requests:
                s.abort(rng.choice(list(s.requests)))
            if rng.random() < 0.1 and s.running:
                r = rng.choice(s.running)
                if not r.is_prefilling and r.num_output_tokens < r.max_tokens - 3:
                    s.set_pending(r.request_id)
            if rng.random() < 0.2 and s.pending:
                rid = rng.choice(list(s.pending))
                s.pending[rid].num_output_tokens += rng.randint(0, 2)
                s.resume(rid)
            batch = s.schedule()
            assert batch.num_tokens <= cfg.max_num_batched_tokens
            for c in batch:
                assert len(c.request.block_ids) >= blocks_for(c.end, cfg.block_size)
            commit(s, batch)
            assert_block_invariants(s)


def test_restore_keeps_free_blocks_after_budget_limited_recompute() -> None:
    """b is preempted after one output (9 tokens), re-admitted with blocks for all 9
    tokens (5 blocks of 2), and the budget of 8 recomputes 8 of them. Its counters
    then look like a decode (1 uncomputed, outputs > 0); the restore still gives it
    the 5 blocks it holds, so the replica's free blocks equal the live scheduler's."""
    s = make_scheduler(max_num_batched_tokens=8, block_size=2, num_kv_blocks=8, max_model_len=16)
    s.add("a", 6, 3)
    s.add("b", 8, 6)
    preempted = []
    for _ in range(4):
        preempted += [r.request_id for r in step(s).preempted]
    assert preempted == ["b"]
    b = s.requests["b"]
    assert (b.num_output_tokens, b.num_computed_tokens, len(b.block_ids)) == (1, 8, 5)
    snap = take_snapshot(s, 1, 0.0)
    replica = restore_scheduler(snap)
    assert snap.num_free_blocks == s.blocks.num_free_blocks
    assert replica.blocks.num_free_blocks == snap.num_free_blocks


def test_restore_after_resume_with_appended_tokens() -> None:
    """A pending request returns with 20 peer tokens (a PeerReq); the budget computes 7
    of them. The restore gives it the blocks the live scheduler holds, not blocks for
    all its tokens, so the estimator can replay this instance's snapshot."""
    s = make_scheduler(max_num_batched_tokens=8, block_size=4, num_kv_blocks=16, max_model_len=64)
    s.add("b", 40, 8)
    s.add("a", 2, 60)
    for _ in range(7):
        step(s)
    a = s.requests["a"]
    assert not a.is_prefilling
    s.set_pending("a")
    a.num_output_tokens += 20  # the peer's tokens, appended by the caller before resume
    s.resume("a")
    step(s)
    assert a.num_uncomputed_tokens > 1  # still catching up on the peer's tokens
    snap = take_snapshot(s, 1, 0.0)
    replica = restore_scheduler(snap)
    assert replica.blocks.num_free_blocks == s.blocks.num_free_blocks


def test_resume_respects_max_num_seqs() -> None:
    """Pending requests count against max_num_seqs at admission, so resuming one never
    pushes the running list past the cap."""
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64, block_size=4, num_kv_blocks=64)
    s.add("a", 4, 20)
    step(s)
    s.set_pending("a")
    s.add("b", 4, 20)
    s.add("c", 4, 20)
    step(s)
    s.resume("a")
    step(s)
    assert len(s.running) <= 2


def test_preemption_victims_are_never_already_scheduled() -> None:
    """Victims come from the tail; none of them may already have a chunk in the batch."""
    s = make_scheduler(
        max_num_seqs=8, max_num_batched_tokens=64, block_size=2, num_kv_blocks=12, max_model_len=24
    )
    for i in range(5):
        s.add(f"r{i}", 3, 20)
    for _ in range(60):
        if not s.has_unfinished:
            break
        batch = s.schedule()
        scheduled = {c.request.request_id for c in batch}
        assert not scheduled & {r.request_id for r in batch.preempted}
        commit(s, batch)
        assert_block_invariants(s)


# ---- engine: threads, aborts, preemption, limits -------------------------------------


def test_add_request_duplicate_race_with_step() -> None:
    """An add_request with an id that a step is taking from the inbox (another thread,
    between the inbox and the registration) is refused as a duplicate: it never
    reaches the scheduler's `duplicate request id` assert, which would end the whole
    engine loop, not one request."""
    eng = tiny_engine()
    real_add = eng.scheduler.add
    seen: list[str] = []

    def add_while_other_thread_submits(rid, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not seen:
            seen.append("called")
            try:  # what a concurrent add_request sees at this instant
                eng.add_request(rid, [5, 6], GREEDY)
                seen.append("accepted")
            except RequestError:
                seen.append("rejected")
        return real_add(rid, *args, **kwargs)

    eng.scheduler.add = add_while_other_thread_submits  # type: ignore[method-assign]
    eng.add_request("dup", [5, 6], GREEDY)
    eng.step()
    eng.scheduler.add = real_add  # type: ignore[method-assign]
    assert seen == ["called", "rejected"]
    drain(eng)


def test_abort_in_every_state_frees_everything() -> None:
    """Abort while in the inbox, waiting after preemption, and running: no leak."""
    eng = tiny_engine(block_size=4, num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=64)
    total = eng.scheduler.blocks.num_free_blocks
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng.add_request("a", list(range(3, 23)), p)
    eng.add_request("b", list(range(30, 50)), p)
    preempted: list[str] = []
    for _ in range(40):
        eng.step()
        waiting = [r.request_id for r in eng.scheduler.waiting]
        if waiting:
            preempted = waiting
            break
    assert preempted, "the scenario should preempt"
    eng.add_request("c", [7, 8, 9], p)
    eng.abort_request("c")  # still in the inbox
    eng.abort_request(preempted[0])  # waiting, holds no KV, has outputs
    outs = eng.step()
    assert {o.request_id for o in outs if o.finish_reason == "abort"} == {"c", preempted[0]}
    running = [r.request_id for r in eng.scheduler.running]
    for rid in running:
        eng.abort_request(rid)
    eng.step()
    assert not eng.has_unfinished()
    assert eng.scheduler.blocks.num_free_blocks == total
    assert eng.snapshot().num_free_blocks == total


def test_preemption_and_recompute_keep_greedy_tokens() -> None:
    """Recompute after preemption (prompt + outputs, chunked, crossing blocks) gives
    the same greedy tokens as an unconstrained run."""
    prompts = [list(range(3, 23)), list(range(100, 113)), list(range(200, 225))]
    p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = tiny_engine(num_kv_blocks=64, max_model_len=64).generate(prompts, p)
    eng = tiny_engine(block_size=4, num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=16)
    count = [0]
    real = eng.scheduler.schedule

    def counting() -> ScheduledBatch:
        batch = real()
        count[0] += len(batch.preempted)  # every preemption is listed in its batch
        return batch

    eng.scheduler.schedule = counting  # type: ignore[method-assign]
    got = eng.generate(prompts, p)
    assert count[0] > 0
    assert got == ref
    assert eng.scheduler.blocks.num_free_blocks == 16


def test_full_context_request_runs_at_max_position() -> None:
    """prompt + max_tokens == max_model_len == max_position_embeddings is accepted
    and runs; one more token is a clear error."""
    model = random_model(1, num_hidden_layers=1, max_position_embeddings=64)
    eng = LLMEngine(engine_config(num_kv_blocks=16, block_size=4, max_model_len=64), model)
    eng.add_request(
        "x", list(range(3, 63)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    assert len(tokens(drain(eng)["x"])) == 4
    with pytest.raises(RequestError, match="maximum context length"):
        eng.add_request("y", list(range(3, 64)), SamplingParams(max_tokens=4))


def test_seed_out_of_range_is_a_request_error() -> None:
    """A seed outside what torch takes ([-2**63, 2**64)) is a RequestError, not torch's
    bare ValueError('Overflow when unpacking long long')."""
    eng = tiny_engine()
    with pytest.raises(RequestError):
        eng.add_request("s", [3, 4], SamplingParams(max_tokens=2, temperature=1.0, seed=2**64))


def test_hook_not_called_when_nothing_sampled() -> None:
    """StepHook is called after every forward that sampled and only then: a step made
    only of mid-prompt prefill chunks does not call it with empty tensors."""
    eng = tiny_engine(max_num_batched_tokens=8)
    calls: list[int] = []
    eng.hook = lambda out: calls.append(len(out.request_ids))
    eng.add_request(
        "x", list(range(3, 23)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    drain(eng)
    assert 0 not in calls


# ---- stop strings --------------------------------------------------------------------


def forced_tokens(monkeypatch: pytest.MonkeyPatch, script: list[int]) -> None:
    """Make the engine 'sample' the given tokens in order (one request)."""
    it = iter(script)

    def fake_sample(logits, states):  # type: ignore[no-untyped-def]
        ids = [next(it) for _ in states]
        for t, s in zip(ids, states, strict=True):
            s.record(t)
        return SampleResult(ids, None, None)

    monkeypatch.setattr(engine_module, "sample", fake_sample)


@pytest.mark.parametrize("stop", ["END", "é!", "한국어"])
def test_stop_string_found_whatever_its_tokenization(
    monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    """The stop-string window covers a stop string whose characters take several
    tokens each: byte-level BPE spends up to 4 tokens per character (here 3
    characters are 8 tokens), and the match is still seen."""
    from shared.model_store import load_tokenizer

    tok = load_tokenizer("random-tiny")
    answer = tok.encode("Hello there " + stop + " and more text after it")
    assert stop in tok.decode(answer)
    forced_tokens(monkeypatch, answer)
    eng = tiny_engine()
    eng.add_request(
        "s",
        [3, 4],
        SamplingParams(max_tokens=len(answer), temperature=0.0, stop=[stop], ignore_eos=True),
    )
    out = drain(eng)["s"]
    assert out[-1].finish_reason == "stop"
    assert len(tokens(out)) < len(answer)


# ---- sampler -------------------------------------------------------------------------


def draws(logits: list[float], n: int = 400, **kw) -> set[int]:  # type: ignore[no-untyped-def]
    state = SamplingState.create(SamplingParams(temperature=1.0, seed=0, **kw))
    row = torch.tensor(logits, dtype=torch.float32)
    return {_sample_row(row, state) for _ in range(n)}


def test_top_p_top_k_support_matches_vllm() -> None:
    """top-p keeps the smallest prefix whose mass reaches p (vLLM/HF); top-k is
    applied first and top-p on the renormalised rest."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert draws(logits, top_p=0.5) == {0}
    assert draws(logits, top_p=0.8) == {0, 1}
    assert draws(logits, top_p=0.81) == {0, 1, 2}
    assert draws(logits, top_k=2) == {0, 1}
    assert draws(logits, top_k=2, top_p=0.6) == {0}  # 0.5/0.8 = 0.625 >= 0.6


def test_top_p_below_float32_range_keeps_the_most_likely_token() -> None:
    """top_p = 1e-320 is valid (in (0, 1]) but rounds to 0 against float32 masses: the
    most likely token must survive, not an empty distribution that fails the step
    (and with it every request on the worker)."""
    logits = torch.tensor([0.2, 0.5, 0.3]).log().tolist()
    assert draws(logits, n=50, top_p=1e-320) == {1}
    assert draws(logits, n=50, top_p=1e-45) == {1}


def test_penalties_use_output_tokens_only_and_openai_formula() -> None:
    params = SamplingParams(
        temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0, max_tokens=4
    )
    state = SamplingState.create(params)
    logits = torch.zeros(1, 10)
    logits[0, 5] = 1.9  # 1.9 - (2 * 0.5 + 1.0) = -0.1 < 0 once 5 was generated twice
    assert sample(logits, [state]).token_ids == [5]  # the prompt never counts
    sample(logits, [state])
    assert state.output_counts == {5: 2}
    assert sample(logits, [state]).token_ids != [5]


def test_logprobs_are_raw_model_logprobs_under_temperature() -> None:
    params = SamplingParams(temperature=0.7, seed=1, logprobs=2, max_tokens=1)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    res = sample(logits, [SamplingState.create(params)])
    raw = torch.log_softmax(logits, -1)[0]
    assert res.logprobs is not None and res.top_logprobs is not None
    assert abs(res.logprobs[0] - float(raw[res.token_ids[0]])) < 1e-6
    assert [i for i, _ in res.top_logprobs[0]] == raw.topk(2).indices.tolist()


# ---- model and loaders ---------------------------------------------------------------


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_attention() -> dict[str, Any]:
    """A Llama-3.x attention shape and RoPE: keywords of HF's LlamaConfig and of
    random_config (a fresh rope_scaling each call: HF may edit it in place)."""
    return dict(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA3),
    )


def hf_llama3_inv_freq() -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(max_position_embeddings=131072, **llama3_attention())
    inv, scale = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert scale == 1.0
    return inv


def test_llama3_rope_formula_matches_hf() -> None:
    cfg = random_config(**llama3_attention())
    torch.testing.assert_close(rope_inv_freq(cfg), hf_llama3_inv_freq(), rtol=1e-6, atol=0)


def test_from_hf_reads_rope_parameters_written_by_transformers_v5() -> None:
    """transformers >= 5 saves RoPE settings as `rope_parameters` (rope_theta inside)
    and no `rope_scaling`: from_hf reads the scaling from there too, so a Llama-3.x
    checkpoint saved by current transformers runs its scaled RoPE."""
    import json

    from transformers import LlamaConfig

    hf = LlamaConfig(
        vocab_size=100,
        intermediate_size=512,
        num_hidden_layers=1,
        max_position_embeddings=131072,
        **llama3_attention(),
    )
    on_disk = json.loads(hf.to_json_string())
    assert (
        on_disk.get("rope_scaling") is None and on_disk["rope_parameters"]["rope_type"] == "llama3"
    )
    cfg = ModelConfig.from_hf(on_disk)
    assert cfg.rope_theta == 500000.0
    torch.testing.assert_close(rope_inv_freq(cfg), hf_llama3_inv_freq(), rtol=1e-6, atol=0)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute (n_head already the kv count for k)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_layerless_gguf(path: Path, extra: Callable[[Any], None]) -> Path:
    """A Llama GGUF with no layers (what load_gguf reads of its settings), and what
    `extra` adds to the writer."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(0)
    w.add_context_length(256)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_tensor("token_embd.weight", np.zeros((10, 32), dtype=np.float32))
    extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("heads,head_dim", [(4, 16), (2, 8), (3, 64)])
def test_gguf_unpermute_inverts_llama_cpp_permute(heads: int, head_dim: int) -> None:
    w = np.random.default_rng(0).standard_normal((heads * head_dim, 24)).astype(np.float32)
    np.testing.assert_array_equal(_unpermute_rope(_llama_cpp_permute(w, heads), heads), w)
    b = np.arange(heads * head_dim, dtype=np.float32)  # 1-D (bias) too
    np.testing.assert_array_equal(_unpermute_rope(_llama_cpp_permute(b, heads), heads), b)


def test_gguf_rope_freqs_tensor_is_not_silently_dropped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """llama.cpp stores Llama-3.1+ RoPE scaling as a `rope_freqs` tensor (per
    frequency divisors): load_gguf applies it (cfg.rope_scaling / factors) or refuses
    the checkpoint with a clear ValueError, never loads it with plain RoPE."""
    from services.worker.engine.loader import load_gguf

    factors = np.ones(8, dtype=np.float32)
    factors[4:] = 8.0

    def llama31(w: Any) -> None:
        w.add_rope_freq_base(500000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
        w.add_tensor("rope_freqs.weight", factors)

    path = write_layerless_gguf(tmp_path / "tiny-llama31.gguf", llama31)
    try:
        cfg, _ = load_gguf(path)
    except ValueError:
        return  # refusing is acceptable
    assert cfg.rope_freq_factors == tuple(float(x) for x in factors), "rope_freqs was dropped"
    from services.worker.engine.attention import rope_inv_freq

    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.allclose(rope_inv_freq(cfg), plain / torch.tensor(factors))


def test_gguf_end_of_turn_token_stops_generation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Llama-3-style GGUFs carry the chat end-of-turn token separately
    (tokenizer.ggml.eot_token_id, e.g. <|eot_id|> 128009, next to eos 128001):
    load_gguf stops on it too, so chat answers end with the turn."""
    from services.worker.engine.loader import load_gguf

    def llama3_chat(w: Any) -> None:
        w.add_eos_token_id(1)
        w.add_eot_token_id(3)

    path = write_layerless_gguf(tmp_path / "tiny-eot.gguf", llama3_chat)
    cfg, _ = load_gguf(path)
    assert set(cfg.eos_token_ids) >= {1, 3}


# ---- CUDA (skipped here; each fails on a GPU machine today) ----------------------------


@CUDA
def test_cuda_chunked_prefill_mask_device() -> None:
    """_attend_prefill builds the offset causal mask with torch.arange on the CPU:
    SDPA with CUDA q/k/v and a CPU attn_mask raises on the first chunked prefill."""
    cpu = tiny_engine(max_num_batched_tokens=16).generate([list(range(3, 43))], GREEDY)
    gpu = tiny_engine("cuda", max_num_batched_tokens=16).generate([list(range(3, 43))], GREEDY)
    assert gpu == cpu


@CUDA
def test_cuda_sampling_penalties_and_logprobs() -> None:
    """The sampler uses a CPU torch.Generator with CUDA probs (multinomial raises),
    CPU count tensors against CUDA rows (penalties raise) and a CPU gather index
    (logprobs raise). Any non-greedy request would kill the step on CUDA."""
    eng = tiny_engine("cuda")
    eng.add_request(
        "t",
        [3, 4],
        SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
    )
    eng.add_request(
        "p",
        [3, 4],
        SamplingParams(max_tokens=4, temperature=0.0, frequency_penalty=1.0, ignore_eos=True),
    )
    eng.add_request(
        "l", [3, 4], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
    )
    outs = drain(eng)
    assert all(len(tokens(outs[r])) == 4 for r in "tpl")
