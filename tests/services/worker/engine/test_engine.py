"""Engine behaviour on a random tiny model: stopping, errors, abort, seeds,
penalties, logprobs, the step hook, snapshots and batch samples."""

from __future__ import annotations

import threading

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine, RequestError
from services.worker.engine.outputs import StepOutputs
from shared.sampling import SamplingParams
from shared.scheduling.scheduler import SchedulerConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.create(
        EngineConfig(
            model="random-tiny",
            dtype="float32",
            scheduler=SchedulerConfig(num_kv_blocks=64, max_model_len=256),
        )
    )


def drain(engine: LLMEngine) -> dict[str, list]:  # type: ignore[type-arg]
    outs: dict[str, list] = {}  # type: ignore[type-arg]
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs: list) -> list[int]:  # type: ignore[type-arg]
    return [t for o in outs for t in o.new_token_ids]


def test_max_tokens_and_usage(engine: LLMEngine) -> None:
    engine.add_request("a", [5, 6, 7], GREEDY)
    out = drain(engine)["a"]
    assert len(tokens(out)) == 12
    last = out[-1]
    assert last.finished and last.finish_reason == "length"
    assert (last.num_prompt_tokens, last.num_output_tokens) == (3, 12)
    assert all(not o.finished for o in out[:-1])


def test_stop_token_ids_and_eos(engine: LLMEngine) -> None:
    engine.add_request("ref", [9, 9, 9], GREEDY)
    ref = tokens(drain(engine)["ref"])
    stop_at = ref[4]
    engine.add_request(
        "s",
        [9, 9, 9],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True),
    )
    out = drain(engine)["s"]
    assert tokens(out) == ref[: ref.index(stop_at) + 1]
    assert out[-1].finish_reason == "stop"
    # The model's EOS ends a request unless ignore_eos is set.
    engine.eos_ids = frozenset({stop_at})
    try:
        engine.add_request("e", [9, 9, 9], SamplingParams(max_tokens=12, temperature=0.0))
        assert drain(engine)["e"][-1].finish_reason == "stop"
    finally:
        engine.eos_ids = frozenset(engine.model.config.eos_token_ids)


def test_stop_string(engine: LLMEngine) -> None:
    from shared.model_store import load_tokenizer

    tok = load_tokenizer("random-tiny")
    engine.add_request("ref", [11, 12], GREEDY)
    ref = tokens(drain(engine)["ref"])
    text = tok.decode(ref[:6])
    stop = text[-3:] if len(text.strip()) >= 3 else text
    engine.add_request(
        "s", [11, 12], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], ignore_eos=True)
    )
    out = drain(engine)["s"]
    assert out[-1].finish_reason == "stop"
    got = tokens(out)
    assert stop in tok.decode(got) and len(got) <= 6


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], GREEDY, "empty"),
        ([1] * 250, SamplingParams(max_tokens=10), "maximum context length is 256"),
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
        ([1], SamplingParams(temperature=-1), "temperature"),
        ([1], SamplingParams(top_p=1.5), "top_p"),
        ([10**9], GREEDY, "token ids"),
    ],
)
def test_bad_requests_get_clear_errors(engine: LLMEngine, prompt, params, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RequestError, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished()


def test_duplicate_id_rejected(engine: LLMEngine) -> None:
    engine.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(RequestError, match="duplicate"):
        engine.add_request("dup", [1, 2], GREEDY)
    drain(engine)


def test_abort_frees_kv_at_next_step(engine: LLMEngine) -> None:
    free0 = engine.scheduler.blocks.num_free_blocks
    engine.add_request("x", list(range(3, 60)), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    assert engine.snapshot().num_free_blocks < free0
    assert [r.request_id for r in engine.snapshot().running] == ["x"]
    engine.abort_request("x")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("x", "abort")]
    assert engine.snapshot().num_free_blocks == free0
    assert engine.snapshot().running == []
    assert not engine.has_unfinished()


def test_seed_reproduces_tokens_whatever_the_batch(engine: LLMEngine) -> None:
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=123, ignore_eos=True)
    engine.add_request("s1", [4, 5, 6], p)
    alone = tokens(drain(engine)["s1"])
    engine.add_request(
        "noise", [8] * 30, SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    )
    engine.add_request("s2", [4, 5, 6], p)
    batched = tokens(drain(engine)["s2"])
    assert alone == batched
    engine.add_request(
        "s3", [4, 5, 6], SamplingParams(max_tokens=10, temperature=1.0, seed=124, ignore_eos=True)
    )
    assert tokens(drain(engine)["s3"]) != alone


def test_top_k_one_is_greedy_and_penalty_changes_output(engine: LLMEngine) -> None:
    engine.add_request("g", [3, 4], GREEDY)
    engine.add_request(
        "k1", [3, 4], SamplingParams(max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True)
    )
    engine.add_request(
        "pen",
        [3, 4],
        SamplingParams(
            max_tokens=12,
            temperature=0.0,
            presence_penalty=2.0,
            frequency_penalty=2.0,
            ignore_eos=True,
        ),
    )
    outs = drain(engine)
    assert tokens(outs["g"]) == tokens(outs["k1"])
    pen = tokens(outs["pen"])
    assert len(set(pen)) >= len(set(tokens(outs["g"])))


def test_logprobs(engine: LLMEngine) -> None:
    engine.add_request(
        "lp", [3, 4], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True)
    )
    outs = drain(engine)["lp"]
    lps = [x for o in outs for x in (o.new_logprobs or [])]
    tops = [x for o in outs for x in (o.new_top_logprobs or [])]
    assert len(lps) == 5 and len(tops) == 5
    for lp, top, tok in zip(lps, tops, tokens(outs), strict=True):
        assert lp <= 0 and len(top) == 3
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-5  # greedy: the top token


def test_step_hook_sees_logits_hidden_and_tokens(engine: LLMEngine) -> None:
    seen: list[StepOutputs] = []
    engine.hook = seen.append
    try:
        engine.add_request(
            "h1", [3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        )
        engine.add_request(
            "h2", [6], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        )
        outs = drain(engine)
    finally:
        engine.hook = None
    assert len(seen) == 3
    first = seen[0]
    assert first.request_ids == ["h1", "h2"]
    assert first.logits.shape == (2, engine.vocab_size)
    assert first.hidden.shape == (2, engine.model.config.hidden_size)
    assert first.token_ids == first.logits.argmax(-1).tolist()
    assert [s.token_ids[0] for s in seen] == tokens(outs["h1"])


def test_batch_samples_and_snapshot_versions(engine: LLMEngine) -> None:
    engine.pop_batch_samples()
    v0 = engine.snapshot().version
    engine.add_request("b1", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    drain(engine)
    samples = engine.pop_batch_samples()
    assert len(samples) == 4
    assert samples[0].num_prefill_tokens == 37 and samples[0].chunk_sizes == [37]
    assert all(s.num_decode_tokens == 1 and s.duration_s > 0 for s in samples[1:])
    assert samples[-1].context_lens == [37 + 3]
    assert engine.snapshot().version == v0 + 4


def test_add_request_from_another_thread_while_stepping(engine: LLMEngine) -> None:
    results: dict[str, list[int]] = {}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set() or engine.has_unfinished():
            for o in engine.step():
                results.setdefault(o.request_id, []).extend(o.new_token_ids)

    t = threading.Thread(target=loop)
    t.start()
    for i in range(20):
        engine.add_request(
            f"t{i}", [3 + i, 4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )
    stop.set()
    t.join(timeout=60)
    assert not t.is_alive()
    assert all(len(results[f"t{i}"]) == 4 for i in range(20))


def test_bf16_runs_and_mostly_agrees_with_fp32() -> None:
    cfg = EngineConfig(
        model="random-tiny",
        dtype="bfloat16",
        scheduler=SchedulerConfig(num_kv_blocks=32, max_model_len=256),
    )
    bf = LLMEngine.create(cfg)
    assert next(bf.model.parameters()).dtype == torch.bfloat16
    out = bf.generate([[5, 6, 7]], GREEDY)
    assert len(out[0]) == 12


def test_predicted_output_tokens_reach_the_snapshot(engine: LLMEngine) -> None:
    engine.add_request(
        "p", [3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True), predicted_output_tokens=42
    )
    engine.step()
    (counters,) = engine.snapshot().running
    assert counters.request_id == "p" and counters.predicted_output_tokens == 42
    engine.abort_request("p")
    drain(engine)


def test_finished_requests_record_their_length_ratio_aborted_ones_do_not(
    engine: LLMEngine,
) -> None:
    """actual / predicted output length goes into the scheduler's window (and so the
    snapshots) for a request that ended by itself, not for an aborted one."""
    ratios = engine.scheduler.length_ratios
    before = list(ratios)
    engine.add_request("r-len", [5, 6], GREEDY, predicted_output_tokens=6)  # 12 of 6: 2.0
    engine.add_request("r-none", [5, 6], GREEDY)  # no prediction: nothing to compare
    engine.add_request("r-abort", [5, 6], GREEDY, predicted_output_tokens=6)
    engine.step()
    engine.abort_request("r-abort")
    drain(engine)
    assert sorted(ratios) == sorted([*before, 2.0])  # r-len's alone


def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it() -> None:
    """`auto` resolves per device: bf16 with AVX-512 BF16 or AMX, fp32 elsewhere on
    CPU (this CPU's flags decide which branch runs); explicit names pass through;
    BATON_DTYPE=auto is accepted; a bad name is a clear error."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    native = bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    cfg = EngineConfig(model="random-tiny")
    assert cfg.dtype == "auto"
    assert cfg.resolved_dtype == ("bfloat16" if native else "float32")
    assert cfg.torch_dtype == (torch.bfloat16 if native else torch.float32)
    assert EngineConfig(dtype="float32").with_env({"BATON_DTYPE": "auto"}).dtype == "auto"
    assert EngineConfig(dtype="bfloat16").resolved_dtype == "bfloat16"
    with pytest.raises(ValueError, match="auto"):
        EngineConfig(dtype="fp8")
    engine = LLMEngine.create(
        EngineConfig(
            model="random-tiny",
            scheduler=SchedulerConfig(num_kv_blocks=16, max_model_len=256),
        )
    )
    assert next(engine.model.parameters()).dtype == cfg.torch_dtype


def test_decode_groups_partition_in_batch_order_at_least_cost() -> None:
    """Decode requests split into groups of similar context length: a partition,
    each group in batch order, one group when a split saves nothing, and no cheaper
    split of the length-sorted requests exists (brute force on small cases)."""
    import itertools
    import random

    from services.worker.engine.runner import decode_groups

    def cost(groups: list[list[int]], blocks: list[int], c: int) -> int:
        return sum(c + len(g) * max(blocks[i] for i in g) for g in groups)

    assert decode_groups([3, 3, 3], 8) == [[0, 1, 2]]
    assert decode_groups([6, 1, 1, 6], 10**6) == [[0, 1, 2, 3]]
    assert decode_groups([6, 1, 1, 6], 0) == [[1, 2], [0, 3]]
    rng = random.Random(3)
    for _ in range(200):
        blocks = [rng.randint(1, 7) for _ in range(rng.randint(1, 7))]
        c = rng.choice([0, 2, 8, 30])
        groups = decode_groups(blocks, c)
        assert sorted(i for g in groups for i in g) == list(range(len(blocks)))
        assert all(g == sorted(g) for g in groups)
        order = sorted(range(len(blocks)), key=blocks.__getitem__)
        best = min(
            cost(
                [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)), strict=True)],
                blocks,
                c,
            )
            for k in range(len(order))
            for cuts in itertools.combinations(range(1, len(order)), k)
        )
        assert cost(groups, blocks, c) == best, (blocks, c, groups)
