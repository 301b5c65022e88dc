"""The delayed-batching chain: predicted throughput of a two-model system for (B_S, B_L),
and the B* table that maximizes it. Pure numpy; no I/O. Derivation: docs/batcher.md.

The system: N requests are active (closed loop: a finished request is replaced at
once). A request is at the small model S (index 0, the entry) or the large model
L (index 1). Each model runs its own step loop on its own hardware; a step takes
every request ready at that model (batch b) and lasts t_m(b) seconds. Model m
starts a step only when at least B_m requests are ready there. After an S step
each request in the batch hands off to L with probability p (a geometric gap of
1/p tokens between sends); after an L step each request in the batch goes back
to S with probability q = 1 / tokens_per_visit_L (a geometric run at L).

State (a_S, w_S, a_L, w_L): a_m requests in model m's step now (0 = idle), w_m
ready at m and waiting; a_S + w_S + a_L + w_L = N, and an idle model holds fewer
than B_m (else it would have started). Events are step completions; the chain
below is the embedded jump chain at those events. The race between two running
steps is decided as if step durations were memoryless with mean t_m(b) (the one
approximation; services/batcher/simulate.py measures its error). Colocated models
slow each other down: a step may take a longer "overlapped" time while the other
model is mid-step too (state-dependent rates; default: no interference).

The jump chain has O(N^3) states but at most 2(N + 1) transitions out of each, so
it is built and solved sparse (SciPy's sparse LU): a dense solve made a full table
(N = 1..16, every feasible pair) take ~4.5 s of CPU, and the batcher recomputes
whenever the estimates move, which on a 2-core machine took a core from the
models it schedules.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import comb

import numpy as np
import scipy.sparse as sp
from scipy.sparse.linalg import MatrixRankWarning, spsolve

# A step latency: a table t[b-1] in seconds for b = 1..N, or a function b -> seconds.
StepLatency = Sequence[float] | np.ndarray | Callable[[int], float]


@dataclass(frozen=True)
class ModelPair:
    """The two models of a token-level preset as the chain (and the simulation) see
    them; the B values and N are asked about separately."""

    p: float  # hand-off probability after each small-model token
    step_latency_s_small: StepLatency
    step_latency_s_large: StepLatency
    tokens_per_visit_large: float = 1.0  # mean run at L: q = 1 / this
    # share of S's hand-offs whose just-sampled S token is taken back (R2R-style
    # rewrite) and so does not count as output
    rewrite_fraction: float = 0.0
    # a model's step time while the other model is also mid-step (colocated models
    # share cores or a GPU); None: the same as alone
    overlap_latency_s_small: StepLatency | None = None
    overlap_latency_s_large: StepLatency | None = None

    def tables(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Step times for b = 1..n: small alone, large alone, small and large overlapped."""
        t_s = latency_table(self.step_latency_s_small, n)
        t_l = latency_table(self.step_latency_s_large, n)
        o_s = (
            t_s
            if self.overlap_latency_s_small is None
            else latency_table(self.overlap_latency_s_small, n)
        )
        o_l = (
            t_l
            if self.overlap_latency_s_large is None
            else latency_table(self.overlap_latency_s_large, n)
        )
        return t_s, t_l, o_s, o_l

    def tabulated(self, n: int) -> ModelPair:
        """The same pair with every latency as a table for b = 1..n (computed once)."""
        t_s, t_l, o_s, o_l = self.tables(n)
        over = self.overlap_latency_s_small is not None, self.overlap_latency_s_large is not None
        return dataclasses.replace(
            self,
            step_latency_s_small=t_s,
            step_latency_s_large=t_l,
            overlap_latency_s_small=o_s if over[0] else None,
            overlap_latency_s_large=o_l if over[1] else None,
        )


@dataclass(frozen=True)
class AffineLatency:
    """t(b) = intercept_s + per_request_s * b (the usual fit of measured step times)."""

    intercept_s: float  # seconds per step at any batch size
    per_request_s: float  # seconds added per request in the batch

    def __call__(self, batch_size: int) -> float:
        return self.intercept_s + self.per_request_s * batch_size


def latency_table(latency: StepLatency, num_active: int) -> np.ndarray:
    """t(b) for b = 1..num_active as a float array (seconds); checks it is positive."""
    if callable(latency):
        table = np.array([latency(b) for b in range(1, num_active + 1)], dtype=float)
    else:
        table = np.asarray(latency, dtype=float)
        if table.ndim != 1 or len(table) < num_active:
            raise ValueError(
                f"a latency table needs {num_active} entries (b = 1..N), got {table.shape}"
            )
        table = table[:num_active]
    if not np.all(np.isfinite(table)) or np.any(table <= 0):
        raise ValueError(f"step latencies must be finite and > 0 s, got {table.tolist()}")
    return table


def is_feasible(num_active: int, b_small: int, b_large: int) -> bool:
    """1 <= B <= N for each model and the deadlock bound B_S + B_L <= N + 1.

    The bound is exactly what rules out a split with both models holding: an idle
    model holds at most B_m - 1 requests, so both idle means N <= B_S + B_L - 2.
    """
    return (
        1 <= b_small <= num_active
        and 1 <= b_large <= num_active
        and (b_small + b_large <= num_active + 1)
    )


def is_deadlock_free(b_small: Sequence[int], b_large: Sequence[int]) -> bool:
    """Every entry of a pair of tables (index N-1) is feasible for its N."""
    return len(b_small) == len(b_large) and all(
        is_feasible(n, bs, bl)
        for n, (bs, bl) in enumerate(zip(b_small, b_large, strict=True), start=1)
    )


@dataclass(frozen=True)
class ChainSolution:
    """The chain's stationary behaviour for one (N, B_S, B_L)."""

    throughput_tok_s: float  # output tokens per second, both models
    small_steps_per_s: float  # S steps per second
    large_steps_per_s: float  # L steps per second
    mean_batch_small: float  # requests per S step
    mean_batch_large: float  # requests per L step
    mean_at_large: float  # requests at L (in its step or waiting), time average
    num_states: int  # tangible states of the chain


def _check_probs(p: float, tokens_per_visit_large: float, rewrite_fraction: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if not tokens_per_visit_large >= 1.0:
        raise ValueError(f"tokens_per_visit_large must be >= 1, got {tokens_per_visit_large}")
    if not 0.0 <= rewrite_fraction <= 1.0:
        raise ValueError(f"rewrite_fraction must be in [0, 1], got {rewrite_fraction}")


def _binomial_pmf(n_max: int, prob: float) -> np.ndarray:
    """pmf[a, j] = P(Binomial(a, prob) = j) for 0 <= j <= a <= n_max (0 elsewhere)."""
    pmf = np.zeros((n_max + 1, n_max + 1))
    for a in range(n_max + 1):
        for j in range(a + 1):
            pmf[a, j] = comb(a, j) * prob**j * (1.0 - prob) ** (a - j)
    return pmf


def solve_chain(pair: ModelPair, num_active: int, b_small: int, b_large: int) -> ChainSolution:
    """Stationary distribution of the embedded chain and the renewal-reward throughput."""
    n = num_active
    p, tokens_per_visit_large = pair.p, pair.tokens_per_visit_large
    rewrite_fraction = pair.rewrite_fraction
    if n < 1:
        raise ValueError(f"N must be >= 1, got {n}")
    if not is_feasible(n, b_small, b_large):
        raise ValueError(
            f"(B_S, B_L) = ({b_small}, {b_large}) is infeasible for N = {n}: "
            "need 1 <= B <= N and B_S + B_L <= N + 1"
        )
    _check_probs(p, tokens_per_visit_large, rewrite_fraction)
    t_s, t_l, o_s, o_l = pair.tables(n)
    q = 1.0 / tokens_per_visit_large

    # 1. Enumerate tangible states; index them by (a_S, a_L, k = a_L + w_L).
    states: list[tuple[int, int, int, int]] = []
    index = -np.ones((n + 1, n + 1, n + 1), dtype=np.int64)
    for run_s in range(n + 1):
        for run_l in range(n + 1 - run_s):
            for wait_l in range(n + 1 - run_s - run_l):
                wait_s = n - run_s - run_l - wait_l
                if (run_s == 0 and wait_s >= b_small) or (run_l == 0 and wait_l >= b_large):
                    continue  # an idle model holding >= B would have started
                if run_s == 0 and run_l == 0:
                    raise AssertionError("both idle: excluded by the deadlock bound")
                index[run_s, run_l, run_l + wait_l] = len(states)
                states.append((run_s, wait_s, run_l, wait_l))
    st = np.array(states, dtype=np.int64)
    a_s, w_s, a_l, w_l = st[:, 0], st[:, 1], st[:, 2], st[:, 3]
    num = len(states)

    def land(a_s2: np.ndarray, w_s2: np.ndarray, a_l2: np.ndarray, w_l2: np.ndarray) -> np.ndarray:
        """Index of the tangible state reached: an idle model that now holds >= B starts."""
        start_s = (a_s2 == 0) & (w_s2 >= b_small)
        a_s2, w_s2 = np.where(start_s, w_s2, a_s2), np.where(start_s, 0, w_s2)
        start_l = (a_l2 == 0) & (w_l2 >= b_large)
        a_l2, w_l2 = np.where(start_l, w_l2, a_l2), np.where(start_l, 0, w_l2)
        idx = index[a_s2, a_l2, a_l2 + w_l2]
        assert np.all(idx >= 0)
        return idx

    # 2. Event rates: each running step completes at rate 1 / t_m(a_m) (memoryless race),
    #    at its overlapped time when the other model is mid-step too.
    both = (a_s > 0) & (a_l > 0)
    b_s, b_l = np.maximum(a_s, 1) - 1, np.maximum(a_l, 1) - 1
    rate_s = np.where(a_s > 0, 1.0 / np.where(both, o_s[b_s], t_s[b_s]), 0.0)
    rate_l = np.where(a_l > 0, 1.0 / np.where(both, o_l[b_l], t_l[b_l]), 0.0)
    total = rate_s + rate_l
    assert np.all(total > 0)

    # 3. Jump chain P: an S completion sends j ~ Bin(a_S, p) to L; an L completion
    #    returns i ~ Bin(a_L, q) to S, the rest stay ready at L.
    rows = np.arange(num)
    pmf_s, pmf_l = _binomial_pmf(n, p), _binomial_pmf(n, q)
    src: list[np.ndarray] = []
    dst: list[np.ndarray] = []
    prob: list[np.ndarray] = []
    for j in range(n + 1):
        r = rows[(a_s > 0) & (j <= a_s)]  # S completes, j of its batch go to L
        if len(r):
            src.append(r)
            dst.append(land(0 * r, w_s[r] + a_s[r] - j, a_l[r], w_l[r] + j))
            prob.append(rate_s[r] / total[r] * pmf_s[a_s[r], j])
        r = rows[(a_l > 0) & (j <= a_l)]  # L completes, j of its batch go back to S
        if len(r):
            src.append(r)
            dst.append(land(a_s[r], w_s[r] + j, 0 * r, w_l[r] + a_l[r] - j))
            prob.append(rate_l[r] / total[r] * pmf_l[a_l[r], j])
    # Duplicate (source, target) entries add up, as the transitions' probabilities do.
    jump = sp.csr_matrix(
        (np.concatenate(prob), (np.concatenate(src), np.concatenate(dst))), shape=(num, num)
    )
    assert np.allclose(np.asarray(jump.sum(axis=1)).ravel(), 1.0)

    # 4. Stationary nu = nu P, sum(nu) = 1 (one recurrent class; transient states get 0):
    #    (P^T - I) nu = 0 with its last equation replaced by the normalisation.
    system = (jump.T - sp.identity(num, format="csr")).tocsr()[:-1]
    system = sp.vstack([system, sp.csr_matrix(np.ones((1, num)))], format="csc")
    rhs = np.zeros(num)
    rhs[-1] = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", MatrixRankWarning)
        try:
            nu = np.asarray(spsolve(system, rhs), dtype=float)
        except MatrixRankWarning:
            nu = np.array([np.nan])
    if not np.all(np.isfinite(nu)):  # singular: the dense least-squares answer
        nu = np.linalg.lstsq(system.toarray(), rhs, rcond=None)[0]
    nu = np.clip(nu, 0.0, None)
    nu /= nu.sum()

    # 5. Renewal reward: rates = E_nu[reward per event] / E_nu[sojourn per event].
    sojourn = 1.0 / total
    cycle_s = float(nu @ sojourn)
    p_s, p_l = rate_s / total, rate_l / total  # probability the next event is S's / L's
    small_tokens = a_s * (1.0 - rewrite_fraction * p)  # expected kept tokens of an S step
    tokens = float(nu @ (p_s * small_tokens + p_l * a_l)) / cycle_s
    s_steps, l_steps = float(nu @ p_s) / cycle_s, float(nu @ p_l) / cycle_s
    time_weight = nu * sojourn / cycle_s  # fraction of time spent in each state
    return ChainSolution(
        throughput_tok_s=tokens,
        small_steps_per_s=s_steps,
        large_steps_per_s=l_steps,
        mean_batch_small=float(nu @ (p_s * a_s)) / cycle_s / s_steps if s_steps > 0 else 0.0,
        mean_batch_large=float(nu @ (p_l * a_l)) / cycle_s / l_steps if l_steps > 0 else 0.0,
        mean_at_large=float(time_weight @ (a_l + w_l)),
        num_states=num,
    )


def predicted_throughput(pair: ModelPair, num_active: int, b_small: int, b_large: int) -> float:
    """Output tokens per second the chain predicts for (N, B_S, B_L)."""
    return solve_chain(pair, num_active, b_small, b_large).throughput_tok_s


@dataclass(frozen=True)
class BestPair:
    """The throughput-maximizing feasible (B_S, B_L) for one N."""

    num_active: int  # N
    b_small: int  # B_S(N)
    b_large: int  # B_L(N)
    throughput_tok_s: float  # predicted at the chosen pair
    eager_throughput_tok_s: float  # predicted at (1, 1), eager async


@dataclass(frozen=True)
class BTable:
    """B*(N) per model for N = 1..len: b_small[N-1], b_large[N-1]."""

    b_small: list[int]
    b_large: list[int]
    throughput_tok_s: list[float]  # predicted at B*(N)
    eager_throughput_tok_s: list[float]  # predicted at (1, 1)


def best_pair(pair: ModelPair, num_active: int, rel_tol: float = 1e-9) -> BestPair:
    """Search every feasible pair; ties (within rel_tol) go to the smaller B_S + B_L
    (less holding means lower latency at the same throughput)."""
    n = num_active
    best: tuple[float, int, int] | None = None
    eager = 0.0
    for total in range(2, n + 2):  # smaller sums first, so ties keep less holding
        for b_s in range(max(1, total - n), min(n, total - 1) + 1):
            b_l = total - b_s
            th = predicted_throughput(pair, n, b_s, b_l)
            if (b_s, b_l) == (1, 1):
                eager = th
            if best is None or th > best[0] * (1.0 + rel_tol):
                best = (th, b_s, b_l)
    assert best is not None
    return BestPair(n, best[1], best[2], best[0], eager)


def best_b(pair: ModelPair, max_active: int) -> BTable:
    """B*(N) per model for N = 1..max_active (deadlock-free by construction)."""
    if max_active < 1:
        raise ValueError(f"max N must be >= 1, got {max_active}")
    tabulated = pair.tabulated(max_active)
    pairs = [best_pair(tabulated, n) for n in range(1, max_active + 1)]
    table = BTable(
        b_small=[x.b_small for x in pairs],
        b_large=[x.b_large for x in pairs],
        throughput_tok_s=[x.throughput_tok_s for x in pairs],
        eager_throughput_tok_s=[x.eager_throughput_tok_s for x in pairs],
    )
    assert is_deadlock_free(table.b_small, table.b_large)
    return table


def fixed_table(max_active: int, b_small: int, b_large: int) -> BTable:
    """The pair (b_small, b_large) for every N, each entry clamped into the feasible set:
    B_S(N) = min(b_small, N), B_L(N) = min(b_large, N, N + 1 - B_S(N))."""
    if b_small < 1 or b_large < 1:
        raise ValueError(f"B values must be >= 1, got ({b_small}, {b_large})")
    small = [min(b_small, n) for n in range(1, max_active + 1)]
    large = [min(b_large, n, n + 1 - bs) for n, bs in enumerate(small, start=1)]
    return BTable(small, large, [], [])


def eager_table(max_active: int) -> BTable:
    """The all-ones table (eager async): deadlock-free for every N, no prediction needed."""
    ones = [1] * max_active
    return BTable(ones, list(ones), [], [])
