"""SimEngine: the real scheduler's batches, exact output lengths, aborts, the virtual and
wall clocks, snapshots with the calibration, and agreement with the SFS replay."""

from __future__ import annotations

import random
import threading
import time

import pytest

from services.estimator.sfs.replay import Probe, estimate
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import RequestError
from services.worker.engine.outputs import RequestOutput
from services.worker.engine.sim import SimEngine, SimEngineConfig
from shared.sampling import SamplingParams
from shared.scheduling.batch_time import FOUR_TERM, SFS_H100_QWEN3, SIX_TERM, BatchTimeModel
from shared.scheduling.scheduler import Scheduler, SchedulerConfig
from shared.scheduling.snapshot import BatchSample, describe_batch
from tests.shared.scheduling.builders import limits as scheduler_limits

# b0 = 1 ms per batch, 10 us per prefill token, 0.1 ms per decode token.
TOY = BatchTimeModel(SIX_TERM, (1e-3, 1e-5, 0.0, 1e-4, 0.0, 0.0))


LIMITS = set(SchedulerConfig.__struct_fields__)


def make(model: BatchTimeModel = TOY, **kw: object) -> SimEngine:
    """A virtual-clock sim engine; limits among `kw` go to its SchedulerConfig."""
    limits = {"block_size": 16, "num_kv_blocks": 64, "max_model_len": 512}
    limits |= {k: v for k, v in kw.items() if k in LIMITS}
    rest = {"clock": "virtual"} | {k: v for k, v in kw.items() if k not in LIMITS}
    scheduler = SchedulerConfig(**limits)  # type: ignore[arg-type]
    return SimEngine.create(SimEngineConfig(scheduler=scheduler, **rest), model)  # type: ignore[arg-type]


def drain(engine: SimEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def params(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def composition(s: BatchSample) -> tuple[object, ...]:
    """A sample without its timing."""
    return (s.num_prefill_tokens, s.num_decode_tokens, s.chunk_sizes, s.context_lens,
            s.num_running, s.num_waiting, s.prefill_context_lens)  # fmt: skip


# ---- the schedule ------------------------------------------------------------------


# step -> arrivals (id, prompt tokens, max_tokens, predicted output tokens)
ARRIVALS: dict[int, list[tuple[str, int, int, int]]] = {
    0: [("a", 70, 40, 30), ("b", 5, 60, 60), ("c", 120, 20, 9)],
    3: [("d", 200, 50, 45), ("e", 16, 30, 100)],
    4: [("f", 33, 64, 1)],
    9: [("g", 150, 80, 70), ("h", 90, 40, 25), ("i", 7, 12, 12)],
    30: [("j", 64, 16, 3)],
}


def test_same_batches_as_a_live_scheduler() -> None:
    # Small KV and budget: chunked prefill, head-of-line blocking and preemption all occur.
    limits = scheduler_limits(seqs=4, budget=64, blocks=24, context=384)
    cfg = SimEngineConfig(clock="virtual", scheduler=limits)
    sim = SimEngine.create(cfg, TOY)
    ref = Scheduler(cfg.scheduler)
    targets: dict[str, int] = {}
    ref_samples: list[tuple[object, ...]] = []
    num_preempted = 0
    for step in range(400):
        for rid, n, max_tokens, pred in ARRIVALS.get(step, []):
            sim.add_request(rid, [100] * n, params(max_tokens), predicted_output_tokens=pred)
            ref.add(rid, n, max_tokens, pred)
            targets[rid] = min(pred, max_tokens)
        sim.step()
        batch = ref.schedule()
        if len(batch) == 0:
            continue
        num_preempted += len(batch.preempted)
        ref.commit(batch)
        for c in batch:
            if c.samples and c.request.num_output_tokens >= targets[c.request.request_id]:
                ref.finish(c.request)
        ref_samples.append(composition(describe_batch(batch, ref, 0.0, 0.0)))
        snap = sim.snapshot()
        assert [r.request_id for r in snap.running] == [r.request_id for r in ref.running]
        assert [r.request_id for r in snap.waiting] == [r.request_id for r in ref.waiting]
        assert snap.num_free_blocks == ref.blocks.num_free_blocks
    assert not sim.has_unfinished() and not ref.has_unfinished
    assert num_preempted > 0, "the case should exercise preemption"
    assert [composition(s) for s in sim.pop_batch_samples()] == ref_samples


# ---- lengths and finish reasons ------------------------------------------------------


def test_output_lengths_are_exact() -> None:
    sim = make()
    sim.add_request("stop", [5] * 10, params(50), predicted_output_tokens=17)
    sim.add_request("cap", [5] * 10, params(8), predicted_output_tokens=40)
    sim.add_request("exact", [5] * 10, params(12), predicted_output_tokens=12)
    sim.add_request("pinned", [5] * 10, params(9, ignore_eos=True), predicted_output_tokens=2)
    sim.add_request("one", [5] * 10, params(9), predicted_output_tokens=0)
    outs = drain(sim)
    eos = sim.config.eos_token_id
    for rid, n, reason in [("stop", 17, "stop"), ("cap", 8, "length"), ("exact", 12, "length"),
                           ("pinned", 9, "length"), ("one", 1, "stop")]:  # fmt: skip
        toks = tokens(outs[rid])
        assert len(toks) == n and outs[rid][-1].num_output_tokens == n, rid
        assert outs[rid][-1].finish_reason == reason and outs[rid][-1].finished, rid
        assert all(not o.finished for o in outs[rid][:-1]), rid
        # EOS only as the last token of a request that stops; no special ids otherwise.
        body = toks[:-1] if reason == "stop" else toks
        assert (toks[-1] == eos) == (reason == "stop"), rid
        assert all(sim.config.first_token_id <= t < sim.vocab_size for t in body), rid


def test_drawn_lengths_follow_the_configured_distribution() -> None:
    fixed = make(output_len_dist="fixed", output_len_mean=23)
    fixed.add_request("x", [1, 2, 3], params(100))
    fixed.add_request("y", [1, 2, 3], params(10))
    outs = drain(fixed)
    assert len(tokens(outs["x"])) == 23 and outs["x"][-1].finish_reason == "stop"
    assert len(tokens(outs["y"])) == 10 and outs["y"][-1].finish_reason == "length"
    # Not in the snapshot: only the router's prediction travels there.
    fixed.add_request("z", [1, 2, 3], params(100))
    fixed.step()
    assert fixed.snapshot().running[0].predicted_output_tokens is None
    cfg = SimEngineConfig(output_len_dist="lognormal", output_len_mean=200, output_len_sigma=0.7)
    draws = [cfg.draw_output_len(random.Random(i)) for i in range(3000)]
    assert 180 < sum(draws) / len(draws) < 220 and min(draws) >= 1


def test_same_seed_same_tokens_whatever_the_order() -> None:
    def run(order: list[str], seed: int) -> dict[str, list[int]]:
        sim = make(seed=seed, output_len_dist="exponential", output_len_mean=20)
        for rid in order:
            sim.add_request(rid, [3] * 5, params(200, stop_token_ids=[500]))
        return {rid: tokens(o) for rid, o in drain(sim).items()}

    one, two = run(["p", "q", "r"], 0), run(["r", "p", "q"], 0)
    assert one == two
    assert all(500 not in toks[:-1] for toks in one.values())
    assert run(["p", "q", "r"], 1) != one


def test_abort_frees_kv_at_the_next_step() -> None:
    sim = make(output_len_dist="fixed", output_len_mean=100)
    total = sim.config.scheduler.num_kv_blocks
    sim.add_request("a", [4] * 40, params(100))
    sim.step()
    held = total - sim.snapshot().num_free_blocks
    assert held > 0
    sim.abort_request("a")
    assert sim.snapshot().num_free_blocks == total - held  # queued, not yet applied
    outs = sim.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [("a", "abort", True)]
    assert sim.snapshot().num_free_blocks == total and not sim.has_unfinished()
    sim.abort_request("unknown")  # ignored, as LLMEngine
    assert sim.step() == [] and not sim.has_unfinished()


def test_request_errors_as_llm_engine() -> None:
    sim = make()
    with pytest.raises(RequestError, match="empty"):
        sim.add_request("e", [], params(4))
    with pytest.raises(RequestError, match="maximum context length"):
        sim.add_request("long", [1] * 500, params(20))
    with pytest.raises(RequestError, match="token ids"):
        sim.add_request("v", [sim.vocab_size], params(4))
    with pytest.raises(RequestError, match="max_tokens"):
        sim.add_request("m", [1], params(0))
    sim.add_request("d", [1], params(4))
    with pytest.raises(RequestError, match="duplicate"):
        sim.add_request("d", [1], params(4))


# ---- clocks ------------------------------------------------------------------------


def test_virtual_ttft_is_the_sum_of_modeled_batch_times() -> None:
    # Budget 64: step 1 prefills 64 of A's 100 tokens (B waits: no budget left);
    # step 2 prefills A's last 36 and all 10 of B, both sample their first token;
    # step 3 decodes both (A stops), step 4 decodes B.
    sim = make(max_num_batched_tokens=64, start_time_s=1000.0)
    sim.add_request("A", [7] * 100, params(10), predicted_output_tokens=2)
    sim.add_request("B", [7] * 10, params(10), predicted_output_tokens=3)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while sim.has_unfinished():
        for o in sim.step():
            first.setdefault(o.request_id, sim.now())
            last[o.request_id] = sim.now()
    t1 = 1e-3 + 64 * 1e-5  # 64 prefill tokens
    t2 = 1e-3 + 46 * 1e-5  # 36 + 10 prefill tokens
    t3 = 1e-3 + 2 * 1e-4  # two decodes
    t4 = 1e-3 + 1e-4
    assert first["A"] - 1000.0 == pytest.approx(t1 + t2, abs=1e-12)
    assert first["B"] - 1000.0 == pytest.approx(t1 + t2, abs=1e-12)
    assert last["A"] - 1000.0 == pytest.approx(t1 + t2 + t3, abs=1e-12)
    assert last["B"] - 1000.0 == pytest.approx(t1 + t2 + t3 + t4, abs=1e-12)
    samples = sim.pop_batch_samples()
    assert [s.duration_s for s in samples] == pytest.approx([t1, t2, t3, t4])
    assert [s.wall_time_s - 1000.0 for s in samples] == pytest.approx(
        [0, t1, t1 + t2, t1 + t2 + t3]
    )
    assert sim.stats.num_steps == 4 and sim.stats.modeled_s == pytest.approx(t1 + t2 + t3 + t4)
    # Idle time: the driver moves the clock to the next arrival; never backwards.
    sim.advance_to(2000.0)
    sim.advance_to(1500.0)
    assert sim.now() == 2000.0
    assert sim.snapshot().wall_time_s == pytest.approx(1000.0 + t1 + t2 + t3 + t4)


def test_virtual_clock_does_not_sleep() -> None:
    slow = BatchTimeModel(SIX_TERM, (1.0, 0.0, 0.0, 0.0, 0.0, 0.0))  # one second per batch
    sim = make(slow)
    sim.add_request("a", [1] * 8, params(50), predicted_output_tokens=50)
    t0 = time.perf_counter()
    drain(sim)
    assert time.perf_counter() - t0 < 5.0  # 50 modeled seconds
    assert sim.now() == pytest.approx(50.0)


def test_wall_clock_sleeps_about_the_modeled_time() -> None:
    b0 = 0.04
    sim = make(BatchTimeModel(SIX_TERM, (b0, 0.0, 0.0, 0.0, 0.0, 0.0)), clock="wall")
    sim.add_request("a", [1] * 8, params(5), predicted_output_tokens=5)
    t0 = time.perf_counter()
    drain(sim)
    elapsed = time.perf_counter() - t0
    modeled = 5 * b0
    assert elapsed >= modeled - 0.005  # each step sleeps out its modeled time
    assert elapsed < 3 * modeled  # loose: the host is shared
    assert sim.stats.modeled_s == pytest.approx(modeled)
    assert sim.stats.measured_s == pytest.approx(elapsed, abs=modeled)
    with pytest.raises(RuntimeError):
        sim.advance_to(0.0)


# ---- snapshots, calibration and the estimator ---------------------------------------


def test_snapshots_carry_the_calibration() -> None:
    model = SFS_H100_QWEN3["qwen3-8b"]
    sim = make(model)
    snap = sim.snapshot()
    assert snap.version == 0
    assert snap.batch_time_features == SIX_TERM and tuple(snap.batch_time_coefs) == model.coefs
    assert BatchTimeModel.from_snapshot(snap) == model
    fitted = BatchTimeModel(FOUR_TERM, (2e-3, 1e-5, 1e-9, 2e-9))
    sim.set_batch_time_model(fitted)
    sim.add_request("a", [1] * 30, params(4), predicted_output_tokens=4)
    sim.step()
    snap = sim.snapshot()
    assert snap.version == 1 and BatchTimeModel.from_snapshot(snap) == fitted
    assert sim.pop_batch_samples()[0].duration_s == pytest.approx(fitted.predict(
        BatchSample(0.0, 0.0, 30, 0, [30], [30], 1, 0, [30])))  # fmt: skip


def test_sfs_replay_on_a_sim_snapshot_predicts_the_sim_exactly() -> None:
    """With exact length predictions the sim is the world the replay models: the estimate
    from a snapshot equals what the sim then does, to the float."""
    model = SFS_H100_QWEN3["qwen3-0.6b"]
    sim = make(model, max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=48)
    for i, (n, out) in enumerate([(300, 40), (20, 90), (150, 10), (60, 60), (400, 30)]):
        sim.add_request(f"r{i}", [9] * n, params(100), predicted_output_tokens=out)
    for _ in range(6):
        sim.step()
    snap = sim.snapshot()
    est = estimate(snap, model, Probe(250, 35, 64), want_e2e=True)
    sim.add_request("probe", [9] * 250, params(64), predicted_output_tokens=35)
    first = last = None
    while sim.has_unfinished():
        for o in sim.step():
            if o.request_id == "probe":
                first = sim.now() if first is None else first
                last = sim.now()
    assert first is not None and last is not None
    assert first - snap.wall_time_s == pytest.approx(est.ttft_s, rel=1e-9)
    assert last - snap.wall_time_s == pytest.approx(est.e2e_s, rel=1e-9)


def test_requests_from_another_thread() -> None:
    sim = make(output_len_dist="fixed", output_len_mean=5)
    done: list[str] = []

    def submit() -> None:
        for i in range(20):
            sim.add_request(f"t{i}", [2] * 4, params(10))

    thread = threading.Thread(target=submit)
    thread.start()
    while thread.is_alive() or sim.has_unfinished():
        done += [o.request_id for o in sim.step() if o.finished]
    thread.join()
    assert sorted(done) == sorted(f"t{i}" for i in range(20))


def test_like_copies_the_engine_limits() -> None:
    limits = scheduler_limits(seqs=5, budget=96, blocks=300, context=1024, block_size=8)
    eng = EngineConfig(num_batch_samples=7, scheduler=limits)
    cfg = SimEngineConfig.like(eng, clock="virtual", seed=3)
    assert cfg.scheduler == eng.scheduler
    assert (cfg.num_batch_samples, cfg.clock, cfg.seed) == (7, "virtual", 3)
    with pytest.raises(ValueError):
        SimEngineConfig(clock="sundial")  # type: ignore[arg-type]
