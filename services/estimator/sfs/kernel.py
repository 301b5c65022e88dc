"""The replay kernel: `shared.scheduling.scheduler.Scheduler`'s policy on flat counters.

`Scheduler` keeps block-id lists and builds a `ScheduledChunk` per request per step;
replaying it (`exact_replay.replay_exact`) costs ~5 ms per instance with 64 running requests,
far too much for 13 instances in a millisecond. This kernel applies the very same rules (running oldest first under
one token budget, recompute-preemption of the newest running request when KV cannot
grow, FIFO admission with head-of-line blocking, no admission in a step that
preempted) on parallel lists of integers holding block *counts* (the policy only
ever counts blocks). `tests/services/estimator/sfs` checks it batch for batch against
`Scheduler` itself on random workloads, so the two cannot drift silently.

Two shortcuts make a step cost O(requests that are not plain decodes):

* **decode group**: the longest prefix of the running list whose requests all
  decode (one uncomputed token, output > 0) advances lazily. Members' counters are
  stored shifted back by the group's offset k, the group keeps its size g and the
  sums C = sum c_i, Q = sum c_i^2 of shifted contexts, so step k has D = g,
  S = C + g k, S2 = Q + 2 C k + g k^2. Each member needs a new KV block every
  block_size steps at a fixed phase (a bucket count per k mod block_size) and
  finishes at a known k (a heap); a finishing member leaves alone, a request behind
  the group that starts decoding joins it. The group is written back (materialized)
  only before a step whose KV growth does not fit (a preemption follows) or whose
  budget it exceeds. Requests behind the group (a prefill chunk, admissions) are
  stepped one by one; preemption victims come from the end of the running list, so
  they never reach into the group.
* **bulk skip**: when the group is the whole running list and the waiting head
  cannot be admitted, the steps up to the next finish (or KV shortage) are summed in
  closed form (sums of t and t^2) and applied at once.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections import deque
from dataclasses import dataclass

INF = math.inf

# The decode group's finish heap holds one int per member, (finishing step k) <<
# _SLOT_BITS | slot: ints compare in C, where (k, slot) tuples cost a tuple each and
# a Python-level comparison per heap move (forming a 64-member group: ~7 -> ~2 us).
# Same order as the tuples. Invariant: slots < 2**_SLOT_BITS (build_state checks).
_SLOT_BITS = 24
_SLOT_MASK = (1 << _SLOT_BITS) - 1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_half_even(x: float) -> int:
    """round(x) for a finite float (x - floor(x) is exact), ~9x cheaper under mypyc,
    whose round() goes through the generic builtin."""
    f = math.floor(x)
    d = x - f
    return f + 1 if d > 0.5 or (d == 0.5 and f % 2 == 1) else f


@dataclass(frozen=True, slots=True)
class RunResult:
    """What one replay measured, on the modeled clock (seconds from the snapshot)."""

    ttft_s: float  # probe's first token; inf if never (stall, step limit, does not fit)
    e2e_s: float  # probe's last token; nan when not asked
    num_steps_ttft: int  # iterations up to and including the first-token one
    num_steps: int  # iterations simulated in all


def build_state(
    limits: tuple[int, int, int, int],
    num_running: int,
    num_pending: int,
    ids: list[str],
    prompt: list[int],
    out: list[int],
    comp: list[int],
    max_tokens: list[int],
    predicted: list[int],
    blocks: list[int],
    default_output: int,
    min_remaining: int,
    ratios: list[float],
    capped_ratios: list[float],
    group: bool = True,
) -> KernelState:
    """A snapshot's scheduler state from its columns, its decode group formed when
    `group` (compiled with the kernel: this runs once per new snapshot per instance).

    limits: (max_num_seqs, max_num_batched_tokens, block_size, num_kv_blocks). Rows
    are running, then pending, then waiting requests (a snapshot's columns);
    `predicted` holds -1 for none, `blocks` the KV blocks each running or pending
    request holds. The lists are copied (the state mutates its own). Each request's end
    is `output_policy.OutputPolicy.target` with `ratios` (`capped_ratios` for a request
    predicted at or past its max_tokens): the same integers.
    """
    max_seqs, max_batched, bs, num_kv_blocks = limits
    n = len(ids)
    if n >= 1 << (_SLOT_BITS - 1):
        raise ValueError(f"{n} requests in one snapshot: more than the kernel's slots")
    num_held = num_running + num_pending
    # Pending requests hold KV and count against the running cap; the replay never
    # resumes them, so the cap left to running requests is fixed.
    st = KernelState(max(0, max_seqs - num_pending), max_batched, bs, 0)
    held = blocks[:num_held]  # waiting requests hold none
    used = sum(held)
    held += [0] * (n - num_held)
    if used > num_kv_blocks:
        raise ValueError(f"the snapshot holds {used} KV blocks, more than its {num_kv_blocks}")
    target = [0] * n
    for i in range(n):
        pred = predicted[i]
        cap = max_tokens[i]
        o = out[i]
        t = default_output if pred < 0 else pred
        if t < 1:
            t = 1
        if t > cap:
            t = cap
        end = o + min_remaining if t < o + min_remaining else t
        rs = capped_ratios if pred >= cap else ratios  # lengths.predicted_capped
        num_ratios = len(rs)
        if num_ratios and pred >= 0:
            # The ends clamp(round(t r), 1, cap) ascend with the ratios, so the ones
            # still ahead of the output are a suffix: bisect for its first index
            # (none has output yet: all), then the request's draw picks one of them.
            lo, hi = 0, num_ratios
            if o > 0:
                while lo < hi:
                    mid = (lo + hi) >> 1
                    e = _round_half_even(t * rs[mid])
                    e = 1 if e < 1 else e
                    if (cap if e > cap else e) > o:
                        hi = mid
                    else:
                        lo = mid + 1
            alive = num_ratios - lo
            if alive:
                e = _round_half_even(t * rs[lo + zlib.crc32(ids[i].encode()) % alive])
                e = 1 if e < 1 else e
                end = cap if e > cap else e
        target[i] = end
    st.free = num_kv_blocks - used
    st.ids = ids.copy()
    st.prompt, st.out, st.comp = prompt.copy(), out.copy(), comp.copy()
    st.held, st.target = held, target
    st.running = list(range(num_running))
    st.waiting = deque(range(num_held, n))
    if group:
        st.absorb()
    return st


class KernelState:
    """Scheduler state as parallel lists, indexed by a request slot."""

    __slots__ = (
        "block_size",
        "comp",
        "free",
        "g",
        "g_c",
        "g_cnt",
        "g_fin",
        "g_k",
        "g_q",
        "held",
        "ids",
        "max_batched",
        "max_seqs",
        "out",
        "prompt",
        "running",
        "target",
        "waiting",
    )

    def __init__(self, max_seqs: int, max_batched: int, block_size: int, free: int) -> None:
        self.max_seqs = max_seqs
        self.max_batched = max_batched
        self.block_size = block_size
        self.free = free  # free KV blocks
        self.ids: list[str] = []
        self.prompt: list[int] = []
        self.out: list[int] = []  # output tokens sampled so far
        self.comp: list[int] = []  # tokens with KV computed
        self.held: list[int] = []  # KV blocks held
        self.target: list[int] = []  # the request finishes when out reaches this
        self.running: list[int] = []  # slots, admission order
        self.waiting: deque[int] = deque()  # slots, head first
        # Decode group: running[:g], g_k steps past their stored (shifted) counters.
        self.g = 0
        self.g_k = 0
        self.g_c = 0  # sum of members' shifted computed tokens
        self.g_q = 0  # sum of their squares
        self.g_cnt = [0] * block_size  # members needing a block at step k: [k % block_size]
        self.g_fin: list[int] = []  # heap of finishing step k << _SLOT_BITS | slot

    def add(self, request_id: str, prompt: int, out: int, comp: int, held: int, target: int) -> int:
        """Append a request's counters; returns its slot (not queued anywhere)."""
        self.ids.append(request_id)
        self.prompt.append(prompt)
        self.out.append(out)
        self.comp.append(comp)
        self.held.append(held)
        self.target.append(target)
        return len(self.ids) - 1

    def copy(self) -> KernelState:
        """An independent copy, decode group included."""
        new = KernelState(self.max_seqs, self.max_batched, self.block_size, self.free)
        new.ids = self.ids.copy()
        new.prompt = self.prompt.copy()
        new.out = self.out.copy()
        new.comp = self.comp.copy()
        new.held = self.held.copy()
        new.target = self.target.copy()
        new.running = self.running.copy()
        new.waiting = self.waiting.copy()
        new.g, new.g_k, new.g_c, new.g_q = self.g, self.g_k, self.g_c, self.g_q
        new.g_cnt = self.g_cnt.copy()
        new.g_fin = self.g_fin.copy()
        return new

    # ---- the decode group ------------------------------------------------------------

    def absorb(self) -> None:
        """Grow the decode group over the running requests right behind it that decode.

        A member joins with its counters shifted back by the group's offset k (so
        writing back adds k to every member alike); it needs a KV block at every step
        k' = 1 - c (mod block_size) where c is its shifted computed length, and it
        finishes at step k' = target - shifted output.
        """
        running = self.running
        g = self.g
        if g >= len(running):
            return
        if g == 0:
            # No members (a fresh state, or all left): the offset restarts. The sums,
            # phase counts and finish heap are over members, so they are empty already.
            self.g_k = 0
        bs = self.block_size
        prompt, out, comp, held, target = self.prompt, self.out, self.comp, self.held, self.target
        k = self.g_k
        cnt = self.g_cnt
        n = len(running)
        sum_c = sum_q = 0
        joined: list[int] = []
        while g < n:
            i = running[g]
            c = comp[i]
            o = out[i]
            if prompt[i] + o - c != 1 or o == 0 or not 0 <= held[i] * bs - c < bs:
                break
            if k:  # shift back by the group's offset (none in a group that restarts)
                c -= k
                comp[i] = c
                out[i] = o - k
            sum_c += c
            sum_q += c * c
            cnt[(1 - c) % bs] += 1
            joined.append((target[i] - o + k) << _SLOT_BITS | i)
            g += 1
        if joined:
            self.g_c += sum_c
            self.g_q += sum_q
            fin = self.g_fin
            if len(joined) > 8:
                fin.extend(joined)
                heapq.heapify(fin)
            else:
                for item in joined:
                    heapq.heappush(fin, item)
        self.g = g

    def materialize(self) -> None:
        """Write the group's offset back into its members' counters and dissolve it."""
        k = self.g_k
        if self.g and k:
            bs, comp, out, held = self.block_size, self.comp, self.out, self.held
            for idx in range(self.g):
                i = self.running[idx]
                c = comp[i] + k
                comp[i] = c
                out[i] += k
                blocks = _ceil_div(c, bs)
                if blocks > held[i]:
                    held[i] = blocks  # the free count was charged step by step
        self.g = self.g_k = self.g_c = self.g_q = 0
        self.g_cnt = [0] * self.block_size
        self.g_fin = []

    def _finish_members(self, k: int) -> None:
        """Members whose last token was sampled at group step k leave and free their KV."""
        fin = self.g_fin
        bs, comp, out, held, running = self.block_size, self.comp, self.out, self.held, self.running
        while fin and fin[0] >> _SLOT_BITS == k:
            i = heapq.heappop(fin) & _SLOT_MASK
            c = comp[i]
            self.g_c -= c
            self.g_q -= c * c
            self.g_cnt[(1 - c) % bs] -= 1
            comp[i] = c + k
            out[i] += k
            self.free += max(held[i], _ceil_div(c + k, bs))
            held[i] = 0
            running.remove(i)
            self.g -= 1

    def _group_need(self, k: int, m: int) -> int:
        """Blocks the group needs over steps k+1 .. k+m."""
        cnt, bs = self.g_cnt, self.block_size
        q, r = divmod(m, bs)
        total = q * self.g
        for t in range(k + 1, k + 1 + r):
            total += cnt[t % bs]
        return total

    def _group_time(self, k: int, m: int, coefs: tuple[float, ...]) -> float:
        """Modeled seconds of the group alone over steps k+1 .. k+m (closed form).

        Step t: D = g, S = C + g t, S2 = Q + 2 C t + g t^2, DC = S - g, DD = g^2, HP = 0.
        """
        g, c_sum, q_sum = self.g, self.g_c, self.g_q
        t1 = (k + m) * (k + m + 1) // 2 - k * (k + 1) // 2
        t2 = (k + m) * (k + m + 1) * (2 * (k + m) + 1) // 6 - k * (k + 1) * (2 * k + 1) // 6
        c0, _, _, cd, cs, cs2, cdc, _, cdd, _ = coefs
        s_tot = m * c_sum + g * t1
        return (
            m * (c0 + cd * g + cdd * g * g)
            + cs * s_tot
            + cs2 * (m * q_sum + 2 * c_sum * t1 + g * t2)
            + cdc * (s_tot - g * m)
        )

    def skip_len(self) -> int:
        """Steps that can be applied in bulk now: the group is all that runs, nothing
        can be admitted, no member finishes and the KV holds; 0 if none."""
        g = self.g
        if not g or g != len(self.running) or g > self.max_batched:
            return 0
        m = (self.g_fin[0] >> _SLOT_BITS) - 1 - self.g_k  # stop before the next finish
        if m < 1:
            return 0
        waiting = self.waiting
        if waiting and g < self.max_seqs and self.max_batched > g:
            head = waiting[0]
            need = _ceil_div(self.prompt[head] + self.out[head], self.block_size)
            if need - self.held[head] <= self.free:
                return 0  # it may be admitted: step singly
        if self._group_need(self.g_k, m) > self.free:
            full, left = divmod(self.free, g)  # full cycles of block_size steps fit
            k = self.g_k + full * self.block_size
            cnt, bs = self.g_cnt, self.block_size
            extra = 0
            while cnt[(k + extra + 1) % bs] <= left:
                left -= cnt[(k + extra + 1) % bs]
                extra += 1
            m = min(m, full * bs + extra)
        return m

    def skip(self, m: int, coefs: tuple[float, ...]) -> float:
        """Apply m group-only steps (m <= skip_len()); returns their modeled seconds."""
        dt = self._group_time(self.g_k, m, coefs)
        self.free -= self._group_need(self.g_k, m)
        self.g_k += m
        return dt

    # ---- one iteration ---------------------------------------------------------------

    def step(self, coefs: tuple[float, ...], trace: list[list[tuple[str, int]]] | None) -> float:
        """Schedule, commit and finish one iteration; returns its modeled seconds.

        Returns -1.0 when nothing could be scheduled (the replay cannot progress).
        Mirrors Scheduler.schedule() + Scheduler.commit() + finishing at `target`.
        """
        bs = self.block_size
        budget = self.max_batched
        g = self.g
        if g:
            k = self.g_k + 1
            need_g = self.g_cnt[k % bs]
            if need_g > self.free or g > budget:  # a preemption or a cut: step exactly
                self.materialize()
                g = 0
        running, waiting = self.running, self.waiting
        prompt, out, comp, held = self.prompt, self.out, self.comp, self.held
        p = pp = d = s = s2 = dc = pc = 0
        if g:  # 1a. the decode group: one token each, lazily
            self.free -= need_g
            self.g_k = k
            budget -= g
            d = g
            s = self.g_c + g * k
            s2 = self.g_q + 2 * self.g_c * k + g * k * k
            dc = s - g
        free = self.free
        sched: list[int] = []
        news: list[int] = []
        preempted = False

        # 1. Running requests, oldest first; preempt the newest when KV runs out.
        idx = g
        while idx < len(running) and budget > 0:
            i = running[idx]
            unc = prompt[i] + out[i] - comp[i]
            if unc <= 0:
                idx += 1
                continue
            n = unc if unc < budget else budget
            need = _ceil_div(comp[i] + n, bs) - held[i]
            if need > free:
                victim = -1
                while need > free:
                    victim = running.pop()  # never a group member: index >= idx >= g
                    free += held[victim]
                    held[victim] = 0
                    comp[victim] = 0
                    waiting.appendleft(victim)
                    preempted = True
                    if victim == i:
                        break
                if victim == i:
                    break
            if need > 0:
                free -= need
                held[i] += need
            sched.append(i)
            news.append(n)
            budget -= n
            idx += 1

        # 2. FIFO admission unless this step preempted.
        if not preempted:
            max_seqs = self.max_seqs
            while waiting and budget > 0 and len(running) < max_seqs:
                i = waiting[0]
                total = prompt[i] + out[i]
                need = _ceil_div(total, bs) - held[i]
                if need > free:
                    break
                waiting.popleft()
                if need > 0:
                    free -= need
                    held[i] += need
                running.append(i)
                unc = total - comp[i]
                n = unc if unc < budget else budget
                sched.append(i)
                news.append(n)
                budget -= n
        self.free = free
        if not sched and not g:
            return -1.0
        if trace is not None:
            ids = self.ids
            trace.append(
                [(ids[i], 1) for i in running[:g]]
                + [(ids[i], n) for i, n in zip(sched, news, strict=True)]
            )

        # 3. Commit: KV computed, one token per chunk that reaches the sequence end.
        target = self.target
        finished: list[int] = []
        for i, n in zip(sched, news, strict=True):
            start = comp[i]
            end = start + n
            s += end
            s2 += end * end
            if n == 1 and out[i] > 0:
                d += 1
                dc += start
            else:
                p += n
                pp += n * n
                pc += n * start + n * (n + 1) // 2
            comp[i] = end
            if end == prompt[i] + out[i]:
                out[i] += 1
                if out[i] >= target[i]:
                    finished.append(i)
        for i in finished:
            running.remove(i)
            self.free += held[i]
            held[i] = 0
        if g:
            self._finish_members(k)
        c0, cp, cpp, cd, cs, cs2, cdc, cpc, cdd, chp = coefs
        t = c0 + cp * p + cpp * pp + cd * d + cs * s + cs2 * s2 + cdc * dc + cpc * pc + cdd * d * d
        return t + chp if p else t

    # ---- the replay ----------------------------------------------------------------------

    def run(
        self,
        coefs: tuple[float, ...],
        probe: int,
        *,
        want_e2e: bool = False,
        max_steps: int = 1_000_000,
        fast: bool = True,
        trace: list[list[tuple[str, int]]] | None = None,
    ) -> RunResult:
        """Step until the probe's first token (and its last, if want_e2e). Mutates self.

        Time is the sum of modeled batch times: TTFT counts every iteration up to and
        including the one that samples the probe's first token. `fast` enables the
        decode group; bulk skipping also needs `trace` to be None.
        """
        clock = 0.0
        steps = 0
        ttft = INF
        steps_ttft = 0
        out, target = self.out, self.target
        can_skip = fast and trace is None
        while steps < max_steps:
            if fast:
                self.absorb()
            if can_skip and self.g:
                m = self.skip_len()
                if m:
                    m = min(m, max_steps - steps)
                    clock += self.skip(m, coefs)
                    steps += m
                    continue
            dt = self.step(coefs, trace)
            if dt < 0:
                break  # stalled: nothing schedulable, nothing will change
            clock += dt
            steps += 1
            if ttft == INF and out[probe] >= 1:
                ttft, steps_ttft = clock, steps
                if not want_e2e:
                    return RunResult(ttft, math.nan, steps_ttft, steps)
            # A grouped probe's counters are stored shifted back (this test is false)
            # until it leaves the group at its last token, written back then.
            if ttft != INF and out[probe] >= target[probe]:
                return RunResult(ttft, clock, steps_ttft, steps)
        return RunResult(ttft, INF if want_e2e else math.nan, steps_ttft, steps)
