"""What the estimator knows of each live instance, kept current off the decision path.

    refresh loop (every snapshot_refresh_s):  snapshots of every live instance (one round
        trip) -> a new version is decoded once, parsed once (LatencyEstimator.prepare) and
        reconciled with the ledger
    fit loop (every fit_interval_s):  new batch samples -> OnlineBatchTimeFitter ->
        on a refit: log MAPE, publish BatchTimeCalibration (the worker copies it into
        its snapshots)
    decision:  TTFT from the SFS replay on the cached snapshot while it is fresh,
        else the LPS queue model (stale or missing snapshot)

The SFS replay is in-flight-aware (docs/sfs.md, "Snapshots older than one iteration"):
an engine publishes its snapshot at the end of an iteration and starts the next one
at once, so a request routed `age` seconds later finds that iteration running and
cannot join it:

    TTFT_hat(now) = max(0, T_hat(iteration in flight) - age) + TTFT_hat(rest)

on the model's clock: with the snapshot's recent speed s (measured / modeled time),
age is taken as age / s and the sum is scaled back by s, faded with the wait
(`speed.horizon_factor`).

Ledger entries dispatched before the snapshot's time that it does not show queue
ahead of the iteration in flight (they may be in it); later ones queue behind it,
ahead of the probe.

Times: snapshot ages use the store's wall time (`VersionedBlob.wall_time_s`, stamped
by the writer with time.time()), so a sim worker on a virtual clock ages like any other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from services.estimator.ledger import LedgerEntry
from services.estimator.sfs.baselines import ArrivalRateEstimator, lps_ttft_s
from services.estimator.sfs.correction import TtftCorrection
from services.estimator.sfs.fit import FitResult, OnlineBatchTimeFitter
from services.estimator.sfs.kernel import KernelState
from services.estimator.sfs.output_policy import OutputPolicy
from services.estimator.sfs.replay import (
    Probe,
    admissible_pending,
    in_dispatch_order,
    kernel_state,
    run_in_flight,
    run_on_state,
    snapshot_ids,
)
from shared.config import EstimatorConfig, ModelConfig
from shared.messages.registry import WorkerInfo
from shared.scheduling.batch_time import EIGHT_TERM, BatchTimeModel, raw_from_chunks
from shared.scheduling.snapshot import BatchSample, WorkloadSnapshot
from shared.scheduling.speed import horizon_factor

TtftSource = Literal["sfs", "lps"]

# Used only when an instance has no calibration at all (no snapshot coefficients, no
# fit yet, none in the cluster file): a slow CPU-class guess, so unknown instances
# look busy rather than free.
FALLBACK_PREFILL_TPS = 1000.0  # tokens/s
FALLBACK_DECODE_STEP_S = 0.05  # seconds


_NO_IDS: tuple[WorkloadSnapshot | None, frozenset[str]] = (None, frozenset())


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    ttft_s: float  # seconds from now (inf: cannot serve)
    source: TtftSource  # sfs: replayed on a fresh snapshot; lps: average-case queue model


@dataclass(slots=True)
class InstanceState:
    """One live instance: its latest snapshot, its batch-time fit, its arrival rate."""

    info: WorkerInfo
    fitter: OnlineBatchTimeFitter
    arrivals: ArrivalRateEstimator
    config_model: BatchTimeModel | None  # from the cluster file (sim engines), if any
    snapshot: WorkloadSnapshot | None = None  # latest one read, fresh or not
    snapshot_key: tuple[int, float] = (-1, 0.0)  # (version, store wall time) of `snapshot`
    snapshot_wall_time_s: float = 0.0  # store wall time of `snapshot`
    last_sample_time_s: float = -math.inf  # newest batch sample fed to the fitter
    mean_running: float = 0.0  # time-averaged concurrency from batch samples (LPS k)
    last_fit: FitResult | None = None
    # `visible` and the snapshot it was built from (whichever way `snapshot` was set)
    _visible: tuple[WorkloadSnapshot | None, frozenset[str]] = _NO_IDS

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def visible(self) -> frozenset[str]:
        """Ids of the requests `snapshot` shows: built once per snapshot, however it
        was set, and shared by the ledger's reconcile and the replay's parse."""
        of, ids = self._visible
        snap = self.snapshot
        if of is not snap:
            ids = frozenset() if snap is None else snapshot_ids(snap)
            self._visible = (snap, ids)
        return ids

    def take_snapshot(self, snapshot: WorkloadSnapshot, key: tuple[int, float]) -> None:
        """A newly read snapshot: `key` is its (version, store wall time)."""
        self.snapshot, self.snapshot_key = snapshot, key
        self.snapshot_wall_time_s = key[1]
        self._visible = _NO_IDS  # holds no old snapshot alive until `visible` is read

    def is_fresh(self, now_s: float, max_age_s: float) -> bool:
        return self.snapshot is not None and now_s - self.snapshot_wall_time_s <= max_age_s

    def batch_time_model(self) -> BatchTimeModel | None:
        """The snapshot's calibration, else the estimator's own fit, else the cluster file's."""
        if self.snapshot is not None:
            carried = BatchTimeModel.from_snapshot(self.snapshot)
            if carried is not None:
                return carried
        return self.fitter.model or self.config_model

    def batch_time_speed(self) -> float:
        """Measured / modeled time of the instance's latest iterations under the model
        batch_time_model() returns: the snapshot's factor when that model is the
        snapshot's own calibration (shared/scheduling/speed.py), else 1 (also for a factor that is
        not a positive number: it divides the snapshot's age)."""
        snap = self.snapshot
        if snap is None or not snap.carries_calibration:
            return 1.0
        speed = snap.batch_time_speed
        return speed if math.isfinite(speed) and speed > 0.0 else 1.0

    def add_samples(self, samples: Iterable[BatchSample]) -> FitResult | None:
        new = [s for s in samples if s.wall_time_s > self.last_sample_time_s]
        if not new:
            return None
        self.last_sample_time_s = max(s.wall_time_s for s in new)
        mean_new = sum(s.num_running for s in new) / len(new)
        if self.mean_running == 0:
            self.mean_running = mean_new
        else:
            self.mean_running = 0.8 * self.mean_running + 0.2 * mean_new
        fit = self.fitter.add(new)
        if fit is not None:
            self.last_fit = fit
        return fit


def create_instance_state(
    info: WorkerInfo, model: ModelConfig | None, settings: EstimatorConfig
) -> InstanceState:
    config_model = None
    if model is not None and model.batch_time_features and model.batch_time_coefs:
        config_model = BatchTimeModel(model.batch_time_features, tuple(model.batch_time_coefs))
    # A configured model (a sim engine's) keeps its feature set; real engines get the
    # CPU default (batch_time.py says why eight terms).
    feature_set = config_model.feature_set if config_model is not None else EIGHT_TERM
    fitter = OnlineBatchTimeFitter(
        feature_set, refit_every=settings.fit_refit_every, min_samples=settings.fit_min_samples
    )
    return InstanceState(
        info=info,
        fitter=fitter,
        arrivals=ArrivalRateEstimator(window_s=settings.arrival_window_s),
        config_model=config_model,
    )


class LatencyEstimator:
    """Predicted TTFT of a request on an instance: SFS replay or the LPS queue model."""

    def __init__(self, settings: EstimatorConfig, *, max_steps: int = 200_000) -> None:
        self.settings = settings
        self.policy = OutputPolicy(settings.default_output_tokens)
        self.max_steps = max_steps  # replay iterations before a probe counts as never served
        # measured-TTFT feedback per instance (correction.py); factor 1 until warmed up
        alpha = settings.ttft_correction_alpha
        self.correction = TtftCorrection(alpha=alpha) if alpha > 0 else None
        # instance -> ((version, wall time) of the snapshot, its parsed state, the ids
        # it shows, the output policy with its length ratios); parsed off the decision
        # path, copied by each decision.
        self._parsed: dict[
            str, tuple[tuple[int, float], KernelState, frozenset[str], OutputPolicy]
        ] = {}

    def forget(self, instance_id: str) -> None:
        """The instance left: its parsed snapshot and its TTFT correction go."""
        self._parsed.pop(instance_id, None)
        if self.correction is not None:
            self.correction.forget(instance_id)

    def prepare(self, state: InstanceState) -> None:
        """Parse a newly read snapshot now, so a decision only copies the parsed state."""
        if state.snapshot is not None and state.batch_time_model() is not None:
            try:
                self._parse(state)
            except ValueError:  # an inconsistent snapshot: decisions use the queue model
                self._parsed.pop(state.instance_id, None)

    def _parse(self, state: InstanceState) -> tuple[KernelState, frozenset[str], OutputPolicy]:
        """The state's snapshot parsed (cached per version), its ids, its output policy."""
        snapshot = state.snapshot
        assert snapshot is not None
        key = (snapshot.version, snapshot.wall_time_s)
        hit = self._parsed.get(state.instance_id)
        if hit is None or hit[0] != key:
            policy = self.policy.for_snapshot(snapshot)
            hit = (key, kernel_state(snapshot, policy), state.visible, policy)
            self._parsed[state.instance_id] = hit
        return hit[1], hit[2], hit[3]

    def ttft(
        self,
        state: InstanceState,
        probe: Probe,
        pending: list[LedgerEntry],
        now_wall_s: float,
        now_mono_s: float,
    ) -> TtftEstimate:
        model = state.batch_time_model()
        snap = state.snapshot
        if (
            snap is not None
            and model is not None
            and state.is_fresh(now_wall_s, self.settings.snapshot_max_age_s)
        ):
            speed = state.batch_time_speed()
            try:
                ttft_s = self._sfs_ttft_s(state, snap, model, probe, pending, now_wall_s, speed)
            except ValueError:  # e.g. more KV held than the capacity: not replayable
                pass
            else:
                if speed != 1.0:
                    ttft_s *= horizon_factor(speed, ttft_s, self.settings.speed_horizon_s)
                if self.correction is not None:
                    ttft_s *= self.correction.factor(state.instance_id)
                return TtftEstimate(ttft_s, "sfs")
        return TtftEstimate(self._lps_ttft_s(state, probe, model, now_mono_s), "lps")

    def _sfs_ttft_s(
        self,
        state: InstanceState,
        snap: WorkloadSnapshot,
        model: BatchTimeModel,
        probe: Probe,
        pending: list[LedgerEntry],
        now_wall_s: float,
        speed: float,
    ) -> float:
        """The in-flight-aware replay (module docstring), in *modeled* seconds from now.

        Same arithmetic as `bench.sfs_evaluation.estimate_from_now` on the cached parsed state;
        ages and dispatch times are wall times (the store's time of the snapshot,
        `LedgerEntry.dispatched_at_s`), put on the model's clock by dividing by
        `speed` (measured / modeled iteration time now): an engine running 1.2x the
        model's time has done 1 / 1.2 of the modeled iterations since its snapshot,
        and what is left of the one in flight is modeled end - age / speed. The caller
        scales the result back by the speed (faded with the wait, `horizon_factor`);
        left on the wall clock, the elapsed part was scaled with the rest.
        """
        base, visible, policy = self._parse(state)  # (of snap: state.snapshot)
        st = base.copy()
        snap_t = state.snapshot_wall_time_s
        age_s = max(0.0, now_wall_s - snap_t) / speed
        # 1. The iterations run since the snapshot, to the one in flight now (none:
        #    idle); unseen dispatches join the first that starts after them, the rest
        #    (and the probe) wait behind the one in flight.
        entries, _ = admissible_pending(pending, snap, visible)
        unseen = in_dispatch_order(
            entries, {e.request_id: (e.dispatched_at_s - snap_t) / speed for e in pending}
        )
        in_flight_s, later = run_in_flight(st, model.raw, age_s, self.max_steps, policy, unseen)
        # 2. The replay from its end to the probe's first token.
        r = run_on_state(
            st,
            later,
            probe,
            model.raw,
            policy,
            max_model_len=snap.scheduler.max_model_len,
            max_steps=self.max_steps,
        )
        return max(0.0, in_flight_s - age_s) + r.ttft_s

    def _lps_ttft_s(
        self,
        state: InstanceState,
        probe: Probe,
        model: BatchTimeModel | None,
        now_mono_s: float,
    ) -> float:
        """LPS: W = rho^k / (mu - alpha) + prompt / theta_pre (baselines.lps_ttft_s).

        k: the instance's time-averaged concurrency (batch samples), at least 1;
        alpha: this estimator's dispatch rate to it (EWMA); mu = k / (service time of
        one request at concurrency k) with the batch-time model: its prefill plus
        predicted-output decode steps of a k-request batch.
        """
        k = max(1, round(state.mean_running))
        prompt, out = probe.num_prompt_tokens, max(1, probe.predicted_output_tokens)
        if model is None:
            prefill_tps, step_s = FALLBACK_PREFILL_TPS, FALLBACK_DECODE_STEP_S
        else:
            budget = state.snapshot.scheduler.max_num_batched_tokens if state.snapshot else prompt
            chunk = max(1, min(prompt, budget))
            prefill_s = max(1e-9, model.predict_raw(raw_from_chunks([(0, chunk, False)])))
            prefill_tps = chunk / prefill_s
            ctx = prompt + out // 2
            step_s = max(1e-9, model.predict_raw(raw_from_chunks([(ctx, 1, True)] * k)))
        service_s = prompt / prefill_tps + out * step_s
        mu = k / service_s
        alpha = state.arrivals.rate(now_mono_s)
        return lps_ttft_s(alpha, mu, k, prompt, prefill_tps)
