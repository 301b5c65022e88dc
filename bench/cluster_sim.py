"""Discrete-event simulation of a routed cluster on one virtual clock, in one process.

The estimator's own pieces decide (policy objects from `services.estimator.policies`,
`LatencyEstimator` with its `SfsReplayer`, `InstanceState`, `Ledger`), exactly as
`EstimatorService.route` wires them; each instance is a `SimEngine` (the engine's
real `Scheduler`, iterations timed by the instance's batch-time model) on a virtual
clock. What the service does over NATS and Redis is modelled by delays:

    arrival at t   -> decision on the snapshots as of the last refresh tick
                      (floor(t / snapshot_refresh_s) * snapshot_refresh_s: the service's
                      background read), ledger entries reconciled then
                   -> the request reaches the chosen instance's inbox at t + dispatch_delay_s
    instance step  -> starts when the instance has work; its snapshot becomes readable
                      at the step's end; an idle instance's snapshot counts as fresh (its
                      worker rewrites it every heartbeat, well inside snapshot_max_age_s)
    finish         -> the ledger entry goes (the service's RequestDoneEvent)

TTFT is measured from the arrival (the routing decision is instantaneous on the
virtual clock) to the end of the iteration that samples the request's first token.
Each request's true output length is the workload's; the router (snapshots, ledger,
probe) only sees its predicted length. The run stops once every request has its first
token, or `drain_s` after the last arrival (the rest count as never served).

Not modelled: decision compute time (~0.1-1 ms, `bench_sfs.py` part 4), the online
batch-time fit (the sims price with the very coefficients their snapshots carry), the
LPS fallback (no snapshot goes stale here).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from bench.sfs_evaluation import estimate_from_now
from services.estimator.instances import InstanceState, LatencyEstimator, create_instance_state
from services.estimator.ledger import Ledger, LedgerEntry
from services.estimator.policies import InstanceView, Policy, Scores
from services.estimator.sfs.output_policy import OutputPolicy
from services.estimator.sfs.replay import PendingRequest, Probe
from services.worker.engine.outputs import FinishReason
from services.worker.engine.sim import SimEngine, SimEngineConfig, SimSequence
from shared.config import ClusterConfig
from shared.messages.estimator import RouteRequest
from shared.messages.registry import WorkerInfo
from shared.sampling import SamplingParams
from shared.scheduling.batch_time import BatchTimeModel
from shared.scheduling.snapshot import WorkloadSnapshot

PROMPT_TOKEN_ID = 100  # every simulated prompt token (lengths are all the sim reads)


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One query of the workload."""

    request_id: str
    arrival_s: float  # virtual seconds
    task: str  # key of the models' quality tables
    num_prompt_tokens: int  # tokens
    num_output_tokens: int  # tokens the answer really has
    predicted_output_tokens: int  # tokens the router believes it will have
    max_tokens: int  # the request's cap, tokens
    ttft_target_s: float  # seconds


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one request."""

    request: SimRequest
    instance_id: str
    model: str
    ttft_s: float  # inf: no first token before the run ended
    predicted_ttft_s: float  # the chosen instance's prediction (nan if the policy has none)
    utility: float  # acc - lambda * cost at the chosen model, true output length

    @property
    def on_time(self) -> bool:
        return self.ttft_s <= self.request.ttft_target_s


@dataclass(frozen=True, slots=True)
class ClusterSimSettings:
    """Timing of the service that the simulation stands in for."""

    dispatch_delay_s: float = 0.001  # decision -> worker inbox (a NATS hop)
    drain_s: float = 120.0  # virtual seconds after the last arrival before giving up


@dataclass(slots=True)
class ClusterRun:
    """A finished simulation: one outcome per request, in arrival order."""

    outcomes: list[Outcome]
    num_steps: dict[str, int]  # iterations per instance
    end_s: float  # virtual time the run stopped

    def on_time_utility(self) -> float:
        """(1/N) sum U_i 1{TTFT_i <= tau_i}: misses count zero (SFS paper)."""
        n = len(self.outcomes)
        return sum(o.utility for o in self.outcomes if o.on_time) / n if n else 0.0

    def mean_utility(self) -> float:
        n = len(self.outcomes)
        return sum(o.utility for o in self.outcomes) / n if n else 0.0

    def attainment(self) -> float:
        """Share of requests whose TTFT met the target."""
        n = len(self.outcomes)
        return sum(1 for o in self.outcomes if o.on_time) / n if n else 0.0

    def ttfts(self) -> list[float]:
        return [o.ttft_s for o in self.outcomes]

    def share_by_model(self) -> dict[str, dict[str, float]]:
        """task -> model -> share of that task's requests routed there."""
        counts: dict[str, dict[str, int]] = {}
        for o in self.outcomes:
            per = counts.setdefault(o.request.task, {})
            per[o.model] = per.get(o.model, 0) + 1
        return {t: {m: c / sum(per.values()) for m, c in per.items()} for t, per in counts.items()}


class WorkloadSimEngine(SimEngine):
    """SimEngine whose requests run to the workload's true length, not the prediction.

    The plain SimEngine takes predicted_output_tokens as the truth; here the truth is
    registered per request id (`expect`) and the prediction only travels into
    snapshots, as with a real engine behind a length predictor.
    """

    def __init__(self, config: SimEngineConfig, model: BatchTimeModel) -> None:
        super().__init__(config, model)
        self._true_lengths: dict[str, int] = {}

    def expect(self, request_id: str, num_output_tokens: int) -> None:
        self._true_lengths[request_id] = num_output_tokens

    def _new_sequence(
        self, request_id: str, num_prompt_tokens: int, params: SamplingParams, predicted: int | None
    ) -> SimSequence:
        seq = super()._new_sequence(request_id, num_prompt_tokens, params, predicted)
        true = self._true_lengths.pop(request_id, None)
        if true is not None and not params.ignore_eos:
            seq.target = min(max(true, 1), params.max_tokens)
            seq.finish_reason = (
                FinishReason.LENGTH if seq.target >= params.max_tokens else FinishReason.STOP
            )
        return seq


@dataclass(slots=True)
class _Instance:
    """One simulated worker and what the estimator has read of it."""

    state: InstanceState
    engine: WorkloadSimEngine
    # (virtual time it became readable, snapshot), oldest first; the head is the one
    # the estimator reads once the next entry is not yet readable.
    published: deque[tuple[float, WorkloadSnapshot]] = field(default_factory=deque)
    stepping: bool = False  # a STEP event is queued
    num_steps: int = 0


_DELIVER, _DONE, _STEP, _ARRIVE = 0, 1, 2, 3  # same-time order: inbox before step


def build_instances(
    cluster: ClusterConfig, *, seed: int = 0
) -> list[tuple[WorkerInfo, SimEngineConfig, BatchTimeModel]]:
    """Every replica of the cluster file's sim instances: (info, engine config, model)."""
    out = []
    for inst in cluster.instances:
        mc = cluster.models[inst.model]
        if mc.engine != "sim":
            raise ValueError(f"model {inst.model!r} is not engine = 'sim'")
        # (these three are set below: a virtual clock from 0, no samples kept)
        set_here = ("clock", "start_time_s", "num_batch_samples")
        sim_fields = {k: v for k, v in mc.sim.items() if k not in set_here}
        for r, iid in enumerate(cluster.replica_ids(inst)):  # the launcher's ids
            cfg = SimEngineConfig(
                clock="virtual",
                seed=seed + inst.seed + r,
                num_batch_samples=1,  # samples are not read here
                scheduler=inst.scheduler,
                **sim_fields,  # type: ignore[arg-type]
            )
            info = WorkerInfo(
                instance_id=iid,
                model=inst.model,
                inbox=f"sim.{iid}",
                max_model_len=inst.scheduler.max_model_len,
                max_num_seqs=inst.scheduler.max_num_seqs,
                started_at_s=0.0,
                heartbeat_at_s=0.0,
            )
            model = BatchTimeModel(mc.batch_time_features, tuple(mc.batch_time_coefs))
            out.append((info, cfg, model))
    return out


def build_views(
    cluster: ClusterConfig,
    policy: Policy,
    latency: LatencyEstimator,
    ledger: Ledger,
    states: Sequence[InstanceState],
    request: RouteRequest,
    probe: Probe,
    now_wall_s: float,
    now_mono_s: float,
) -> list[InstanceView]:
    """What `EstimatorService._views` builds for a decision: per candidate instance its
    fresh snapshot, its ledger entries and, for utility policies, the request's
    accuracy, cost and predicted TTFT there."""
    est = cluster.estimator
    views: list[InstanceView] = []
    for state in states:
        fresh = state.snapshot if state.is_fresh(now_wall_s, est.snapshot_max_age_s) else None
        pending = ledger.pending(state.instance_id)
        scores = None
        if policy.needs_scores:
            mc = cluster.models[state.info.model]
            estimate = None
            if policy.needs_ttft:  # computed only if the policy reads it
                estimate = partial(latency.ttft, state, probe, pending, now_wall_s, now_mono_s)
            scores = Scores(
                mc.accuracy(request.task),
                mc.cost(request.num_prompt_tokens, probe.predicted_output_tokens),
                estimate=estimate,
            )
        views.append(InstanceView(state.info, fresh, pending, scores))
    return views


def make_requests(
    offsets: Sequence[float],
    tasks: Mapping[str, Sequence[tuple[int, int]]],
    rng: random.Random,
    *,
    max_model_len: int,
    ttft_target_s: Callable[[int], float],
    length_error: float = 0.0,
    max_tokens_cap: int = 8192,
) -> list[SimRequest]:
    """One request per arrival offset: task uniform over `tasks`, then one of its
    (prompt tokens, output tokens) pairs uniformly.

    Prompts are cut to leave room for one output token; max_tokens = min(cap, room);
    the true output is capped by max_tokens; the prediction is the true output times
    (1 + U(-length_error, length_error)), rounded, at least 1.
    """
    if not tasks or any(not v for v in tasks.values()):
        raise ValueError("every task needs at least one (prompt, output) pair")
    if not 0 <= length_error < 1:
        raise ValueError("length_error must be in [0, 1)")
    names = sorted(tasks)
    out = []
    for i, t in enumerate(offsets):
        task = names[rng.randrange(len(names))]
        prompt, output = tasks[task][rng.randrange(len(tasks[task]))]
        prompt = min(max(1, prompt), max_model_len - 1)
        max_tokens = min(max_tokens_cap, max_model_len - prompt)
        true = min(max(1, output), max_tokens)
        predicted = max(1, round(true * (1 + rng.uniform(-length_error, length_error))))
        out.append(
            SimRequest(
                request_id=f"q{i}",
                arrival_s=float(t),
                task=task,
                num_prompt_tokens=prompt,
                num_output_tokens=true,
                predicted_output_tokens=predicted,
                max_tokens=max_tokens,
                ttft_target_s=ttft_target_s(prompt),
            )
        )
    return out


def simulate_cluster(
    cluster: ClusterConfig,
    policy: Policy,
    requests: Sequence[SimRequest],
    *,
    lam: float,
    settings: ClusterSimSettings = ClusterSimSettings(),
    preset: str = "auto",
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> ClusterRun:
    """Route `requests` (ascending arrival) with `policy` over the cluster's sim instances.

    lam: the utility's cost weight (U = acc - lam * cost) used for the outcomes' utility;
    the policy carries its own. `progress(n)` is called as requests get routed.
    """
    est = cluster.estimator
    latency = LatencyEstimator(est)
    ledger = Ledger(est.ledger_ttl_s)
    instances: dict[str, _Instance] = {}
    for info, cfg, model in build_instances(cluster, seed=seed):
        engine = WorkloadSimEngine(cfg, model)
        inst = _Instance(create_instance_state(info, cluster.models[info.model], est), engine)
        inst.published.append((0.0, engine.snapshot()))
        instances[info.instance_id] = inst
    allowed = set(cluster.candidates(preset))
    if not allowed:
        raise ValueError(f"preset {preset!r} names no model of the cluster")
    candidates = [i for i in instances.values() if i.state.info.model in allowed]
    if not candidates:
        raise ValueError(f"no sim instance serves preset {preset!r}")

    events: list[tuple[float, int, int, object]] = []
    seq = 0

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, kind, seq, payload))
        seq += 1

    for r in requests:
        push(r.arrival_s, _ARRIVE, r)
    first_token: dict[str, float] = {}
    decided: dict[str, tuple[str, float]] = {}  # request id -> (instance, predicted TTFT)
    by_id = {r.request_id: r for r in requests}
    if len(by_id) != len(requests):
        raise ValueError("request ids must be unique")
    last_arrival = max((r.arrival_s for r in requests), default=0.0)
    now = 0.0
    num_routed = 0

    def refresh(t: float) -> None:
        """The background snapshot read as of the last refresh tick before t."""
        tick = math.floor(t / est.snapshot_refresh_s) * est.snapshot_refresh_s
        for inst in candidates:
            pub = inst.published
            while len(pub) > 1 and pub[1][0] <= tick:
                pub.popleft()
            seen_at, snap = pub[0]
            if seen_at > tick:  # nothing readable yet (only at the very start)
                continue
            state = inst.state
            idle = not inst.engine.has_unfinished() and len(pub) == 1
            wall = tick if idle else seen_at  # an idle worker's heartbeat rewrites it
            key = (snap.version, snap.wall_time_s)
            state.snapshot_wall_time_s = wall
            if key == state.snapshot_key:
                continue
            state.take_snapshot(snap, key)
            state.snapshot_wall_time_s = wall  # the store's time of it, not the writer's
            ledger.reconcile(state.instance_id, state.visible)
            latency.prepare(state)

    def route(r: SimRequest, t: float) -> None:
        refresh(t)
        ledger.expire(t)
        num_output = max(1, r.predicted_output_tokens)
        probe = Probe(r.num_prompt_tokens, num_output, r.max_tokens)
        request = RouteRequest(
            request_id=r.request_id,
            model=preset,
            num_prompt_tokens=r.num_prompt_tokens,
            max_tokens=r.max_tokens,
            ttft_target_ms=r.ttft_target_s * 1000.0,
            task=r.task,
            predicted_output_tokens=r.predicted_output_tokens,
        )
        views = build_views(
            cluster, policy, latency, ledger, [i.state for i in candidates], request, probe, t, t
        )
        chosen = policy.choose(request, views)
        iid = chosen.instance_id
        predicted = chosen.scores.ttft_s if chosen.scores is not None else math.nan
        ledger.add(
            LedgerEntry(
                r.request_id, iid, r.num_prompt_tokens, r.max_tokens, t, r.predicted_output_tokens
            )
        )
        instances[iid].state.arrivals.observe(t)
        decided[r.request_id] = (iid, predicted)
        push(t + settings.dispatch_delay_s, _DELIVER, (iid, r))

    def step(inst: _Instance, t: float) -> None:
        engine = inst.engine
        before = engine.now()
        outputs = engine.step()
        end = engine.now()
        inst.num_steps += 1
        for out in outputs:
            if out.new_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = end
            if out.finished:
                push(end, _DONE, out.request_id)
        inst.published.append((end, engine.snapshot()))
        if engine.has_unfinished():
            if end <= before:
                raise RuntimeError(f"{inst.state.instance_id}: a step with work took no time")
            push(end, _STEP, inst)
        else:
            inst.stepping = False

    while events:
        t, kind, _, payload = heapq.heappop(events)
        now = t
        if len(first_token) == len(requests) and num_routed == len(requests):
            break
        if t > last_arrival + settings.drain_s:
            break
        if kind == _ARRIVE:
            assert isinstance(payload, SimRequest)
            route(payload, t)
            num_routed += 1
            if progress is not None:
                progress(1)
        elif kind == _DELIVER:
            assert isinstance(payload, tuple)
            target_id, r = payload
            assert isinstance(target_id, str) and isinstance(r, SimRequest)
            inst = instances[target_id]
            engine = inst.engine
            engine.expect(r.request_id, r.num_output_tokens)
            engine.add_request(
                r.request_id,
                [PROMPT_TOKEN_ID] * r.num_prompt_tokens,
                SamplingParams(max_tokens=r.max_tokens),
                predicted_output_tokens=r.predicted_output_tokens,
            )
            if not inst.stepping:  # an idle engine wakes at the delivery (or when its
                engine.advance_to(t)  # last step, already computed, ends)
                inst.stepping = True
                push(max(t, engine.now()), _STEP, inst)
        elif kind == _DONE:
            assert isinstance(payload, str)
            ledger.remove(payload)
        else:
            assert isinstance(payload, _Instance)
            step(payload, t)

    outcomes = []
    for r in requests:
        iid, predicted = decided.get(r.request_id, ("", math.nan))
        model_name = instances[iid].state.info.model if iid else ""
        mc = cluster.models.get(model_name)
        util = (
            mc.accuracy(r.task) - lam * mc.cost(r.num_prompt_tokens, r.num_output_tokens)
            if mc is not None
            else 0.0
        )
        ttft = first_token[r.request_id] - r.arrival_s if r.request_id in first_token else math.inf
        outcomes.append(Outcome(r, iid, model_name, ttft, predicted, util))
    return ClusterRun(outcomes, {i: x.num_steps for i, x in instances.items()}, now)


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request offered to a single instance (`simulate_single`)."""

    request_id: str
    arrival_s: float  # seconds from the run's origin
    num_prompt_tokens: int  # tokens
    num_output_tokens: int  # tokens it generates (max_tokens, EOS ignored)


@dataclass(frozen=True, slots=True)
class SingleRun:
    ttft_s: dict[str, float]  # request id -> first token - arrival, seconds (inf: none)
    busy_s: float  # sum of modeled iteration times, seconds
    end_s: float  # virtual time the last request finished (or the run stopped)
    num_steps: int


def simulate_single(
    config: SimEngineConfig,
    model: BatchTimeModel,
    arrivals: Sequence[Arrival],
    *,
    until_first_tokens: bool = False,
    max_steps: int = 10_000_000,
) -> SingleRun:
    """Offer `arrivals` (ascending) to one SimEngine on a virtual clock; run to the end.

    A request arriving during an iteration joins the next one (as with a real engine,
    whose loop takes its inbox at the start of each iteration). `until_first_tokens`
    stops once every request has its first token.
    """
    if config.clock != "virtual":
        raise ValueError("simulate_single needs clock='virtual'")
    engine = SimEngine(config, model)
    first: dict[str, float] = {}
    start = {a.request_id: a.arrival_s for a in arrivals}
    if len(start) != len(arrivals):
        raise ValueError("request ids must be unique")
    busy = 0.0
    steps = 0
    i = 0
    while steps < max_steps:
        # 1. Requests that arrived by now join the inbox; an idle engine jumps ahead.
        if i < len(arrivals) and not engine.has_unfinished():
            engine.advance_to(arrivals[i].arrival_s)
        while i < len(arrivals) and arrivals[i].arrival_s <= engine.now():
            a = arrivals[i]
            engine.add_request(
                a.request_id,
                [PROMPT_TOKEN_ID] * a.num_prompt_tokens,
                SamplingParams(max_tokens=a.num_output_tokens, ignore_eos=True),
            )
            i += 1
        if not engine.has_unfinished():
            if i >= len(arrivals):
                break
            continue
        # 2. One iteration on the modeled clock.
        t0 = engine.now()
        outputs = engine.step()
        busy += engine.now() - t0
        steps += 1
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = engine.now()
        if until_first_tokens and len(first) == len(arrivals):
            break
    ttft = {rid: first[rid] - t if rid in first else math.inf for rid, t in start.items()}
    return SingleRun(ttft, busy, engine.now(), steps)


def sfs_errors_on_sim(
    config: SimEngineConfig,
    model: BatchTimeModel,
    arrivals: Sequence[Arrival],
    predicted_output_tokens: Mapping[str, int],
    policy: OutputPolicy,
    *,
    max_tokens: int | None = None,
    snapshot_period_s: float = 0.0,
) -> tuple[list[float], list[float]]:
    """(predicted, actual) TTFT of every request when each is estimated at its arrival
    from the instance's latest snapshot, as the estimator service does
    (`sfs_evaluation.estimate_from_now`), on one SimEngine with a virtual clock.

    Batch times are exactly `model`, so every error is the replay's own: output lengths
    it has to predict, and requests that arrive after the probe (it cannot know them).
    The estimate's snapshot is taken when an iteration begins, at the first one at least
    `snapshot_period_s` after the last (0: every iteration; the estimator service reads
    snapshots every `snapshot_refresh_s`). Requests added since are unseen: those in the
    inbox when it was taken are `joined` (they join that iteration), the later ones
    `pending`, at their arrival times (they join the first iteration after them).

    Each request generates `num_output_tokens` (the truth) under a cap of `max_tokens`
    (at most what the context leaves); None caps it at the truth, which tells the
    replay every length exactly wherever a prediction overshoots it (a request ends at
    min(prediction, cap)), so use a cap above the lengths to measure predictions.
    A request that never gets a first token (it cannot fit) reads as inf.
    """
    if config.clock != "virtual":
        raise ValueError("sfs_errors_on_sim needs clock='virtual'")

    def cap_of(a: Arrival) -> int:
        room = config.scheduler.max_model_len - a.num_prompt_tokens
        return min(room, a.num_output_tokens if max_tokens is None else max_tokens)

    engine = WorkloadSimEngine(config, model)
    predicted: dict[str, float] = {}
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    inbox: list[PendingRequest] = []  # added during the last iteration, not taken yet
    joined: list[PendingRequest] = []  # in the inbox when `snap` was taken
    since: list[tuple[float, PendingRequest]] = []  # (arrival, entry) added after `snap`
    snap, snap_t = None, -math.inf
    i = 0
    while i < len(arrivals) or engine.has_unfinished():
        # 1. An idle engine jumps to the next arrival; a snapshot is due or not.
        if i < len(arrivals) and not engine.has_unfinished():
            engine.advance_to(max(engine.now(), arrivals[i].arrival_s))
        if snap is None or engine.now() - snap_t >= snapshot_period_s:
            snap, snap_t = engine.snapshot(), engine.now()
            joined, since = inbox, []
        # 2. The iteration in flight; who arrives during it is estimated from `snap`.
        for out in engine.step() if engine.has_unfinished() else []:
            if out.new_token_ids:
                first.setdefault(out.request_id, engine.now())
        inbox = []
        while i < len(arrivals) and arrivals[i].arrival_s <= engine.now():
            a = arrivals[i]
            pred, cap = predicted_output_tokens[a.request_id], cap_of(a)
            probe = Probe(a.num_prompt_tokens, pred, cap)
            est = estimate_from_now(
                snap,
                model,
                probe,
                [e for _, e in since],
                a.arrival_s - snap_t,
                joined=joined,
                pending_offsets_s=[t - snap_t for t, _ in since],
                policy=policy,
            )
            predicted[a.request_id], added[a.request_id] = est.ttft_s, a.arrival_s
            entry = PendingRequest(a.request_id, a.num_prompt_tokens, cap, pred)
            since.append((a.arrival_s, entry))
            inbox.append(entry)
            engine.expect(a.request_id, a.num_output_tokens)
            engine.add_request(
                a.request_id,
                [PROMPT_TOKEN_ID] * a.num_prompt_tokens,
                SamplingParams(max_tokens=cap),
                predicted_output_tokens=pred,
            )
            i += 1
    rids = [a.request_id for a in arrivals]
    return [predicted[r] for r in rids], [first.get(r, math.inf) - added[r] for r in rids]
