"""RouteBalance's end-to-end latency of a request on an instance (the paper's analytic
form over a time-per-output-token estimate):

    E2E = TPOT x L                     when a decode slot is free
    E2E = TPOT x (d / b + L)           else: d pending decode tokens, b the decode batch

L: the request's predicted output tokens there. A slot counts as free while the
instance holds fewer requests than its `max_num_seqs` (the request joins the next
step), not only while nothing waits: the paper's code takes any waiting request as a
full instance, so a second request to an idle one was priced as queued behind the first.
"""

from __future__ import annotations

from services.estimator.routebalance.load import InstanceLoad


def e2e_s(load: InstanceLoad, tpot_s: float, output_tokens: int) -> float:
    """Predicted seconds from dispatch to the last token (TTFT not included)."""
    if load.has_free_slot:
        return tpot_s * output_tokens
    return tpot_s * (load.pending_decode_tokens / load.decode_batch + output_tokens)
