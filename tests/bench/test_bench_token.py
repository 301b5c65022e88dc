"""The pure parts of scripts/bench_token.py: agreement, token shares, the JSON rows, the
targets and the generated cluster file. No serving, no timing."""

from __future__ import annotations

from typing import Any

import pytest

from shared.config import load_cluster, parse_cluster
from tests.scripts import SCRIPTS, load_script

REPO = SCRIPTS.parent
bt = load_script("bench_token")

ROW_KEYS = {
    "policy",
    "mode",
    "concurrency",
    "output_tok_s",
    "mean_ttft_ms",
    "mean_e2el_ms",
    "token_share",
    "agreement_with_large",
    "mean_logprob_large",
}


def test_agreement_is_positionwise_over_the_reference() -> None:
    assert bt.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert bt.agreement([1, 9, 3, 9], [1, 2, 3, 4]) == 0.5
    # A shorter answer misses the reference's tail; a longer one gains nothing.
    assert bt.agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert bt.agreement([1, 2, 3, 4, 5, 6], [1, 2, 3, 4]) == 1.0
    # One inserted token shifts everything after it.
    assert bt.agreement([0, 1, 2, 3], [1, 2, 3, 4]) == 0.0
    with pytest.raises(ValueError, match="empty reference"):
        bt.agreement([1], [])


def test_token_share_sums_requests() -> None:
    share = bt.token_share([{"s": 3, "l": 1}, {"s": 1, "l": 3}, {"s": 4}])
    assert share == {"l": 4 / 12, "s": 8 / 12}
    assert bt.token_share([]) == {}


def cell_with(policy: str | None, mode: str, conc: int, tok_s: float, agree: float) -> Any:
    cell = bt.Cell(policy, mode, conc, wall_s=2.0)
    model = "smollm2-135m" if mode == "large_only" else "smollm2-small"
    cell.replies = [
        bt.Reply(i, "x", int(tok_s), {model: int(tok_s)}, 0.1 * (i + 1), 1.0) for i in range(2)
    ]
    cell.agreements = [agree, agree]
    cell.logprob_sum, cell.logprob_tokens = -agree, 1
    return cell


def test_row_shape_and_values() -> None:
    row = cell_with("r2r", "baton", 8, 10, 0.5).row()
    assert row.keys() >= ROW_KEYS
    assert row["output_tok_s"] == 20 / 2.0  # two replies of 10 tokens in 2 s
    assert row["mean_ttft_ms"] == pytest.approx(150.0)
    assert row["mean_e2el_ms"] == pytest.approx(1000.0)
    assert row["token_share"] == {"smollm2-small": 1.0}
    assert row["agreement_with_large"] == 0.5
    assert row["mean_logprob_large"] == -0.5
    unrun = bt.Cell("r2r", "barrier", 8).row()
    assert unrun.keys() >= ROW_KEYS
    assert unrun["output_tok_s"] is None


def test_targets_met_and_missed() -> None:
    rows = [
        cell_with("r2r", "baton", 8, 30, 0.6).row(),
        cell_with("r2r", "eager_async", 8, 25, 0.6).row(),
        cell_with("r2r", "std_serving", 8, 10, 0.6).row(),
        cell_with(None, "small_only", 8, 40, 0.4).row(),
        cell_with(None, "large_only", 8, 20, 1.0).row(),
        cell_with("r2r", "baton", 1, 6, 0.6).row(),
    ]
    got = {t["target"].split(": ", 1)[1]: t for t in bt.targets(rows)}
    assert got["baton tok/s >= 2x std_serving"]["ratio"] == 3.0
    assert got["baton tok/s >= 2x std_serving"]["met"] is True
    assert got["delayed batching (baton) >= 1.1x eager_async"]["ratio"] == pytest.approx(1.2)
    assert got["agreement_with_large strictly between small_only and large_only"]["met"] is True
    # logprob = -agreement: -0.6 is not between -0.4 (small) and -1.0 (large) in that order.
    assert got["mean_logprob_large strictly between small_only and large_only"]["met"] is False
    scaling = next(t for t in bt.targets(rows) if "scaling" in t["target"])
    assert scaling["figure"] == 5.0 and scaling["anchor"] == bt.PAPER_SCALING
    # Nothing run at concurrency 8: every target says so (None), none is claimed.
    assert all(t["met"] is None for t in bt.targets(rows[5:]))


def test_table_prints_anchor_and_ratio() -> None:
    rows = [
        cell_with("r2r", "baton", 8, 30, 0.6).row(),
        cell_with("r2r", "std_serving", 8, 10, 0.6).row(),
        bt.Cell("r2r", "barrier", 8).row(),
    ]
    text = bt.table(rows)
    assert "| r2r | baton | 8 | 30.0 | std_serving | 10.0 | 3.00 |" in text
    assert "| r2r | barrier | 8 | - | std_serving | 10.0 | - |" in text


def test_cluster_file_has_a_preset_per_policy_and_token_mode() -> None:
    base = load_cluster(REPO / "configs" / "local.toml")
    ports = {"gateway": 18000, "nats": 14222, "redis": 16379}
    text = bt.cluster_text(
        base, ["r2r", "me"], ["baton", "barrier", "std_serving", "large_only"], ports
    )
    cluster = parse_cluster(text)
    assert set(cluster.presets) == {"r2r", "r2r-std", "r2r-barrier", "me", "me-std", "me-barrier"}
    assert cluster.presets["r2r-std"].mode == "std_serving"
    assert cluster.presets["r2r-barrier"].mode == "barrier"
    assert cluster.presets["r2r"].args == base.presets["r2r"].args
    assert cluster.presets["me"].models == ["smollm2-small", "smollm2-medium", "smollm2-135m"]
    assert cluster.gateway.port == 18000
    assert [i.model for i in cluster.instances] == [
        "smollm2-135m",
        "smollm2-medium",
        "smollm2-small",
    ]
    assert cluster.batcher.fixed_b == []
    pinned = parse_cluster(bt.cluster_text(base, ["r2r"], ["baton"], ports, fixed_b=[1, 3]))
    assert pinned.batcher.fixed_b == [1, 3]
    with pytest.raises(SystemExit, match="no token preset"):
        bt.cluster_text(base, ["auto"], ["baton"], ports)


def test_only_selects_cells() -> None:
    cells = bt.plan_cells(["r2r", "me"], ["baton", "large_only"], [1, 8])
    assert len(cells) == 6  # (2 policies + 1 baseline) x 2 concurrencies
    picked = bt.selected(cells, ["me:baton:8", ":large_only:1"])
    assert [(c.policy, c.mode, c.concurrency) for c in picked] == [
        (None, "large_only", 1),
        ("me", "baton", 8),
    ]
    with pytest.raises(SystemExit, match="POLICY:MODE:CONC"):
        bt.selected(cells, ["me:baton"])


def test_rounds_alternate_the_cell_order() -> None:
    cells = bt.plan_cells(["r2r"], ["baton", "eager_async"], [8])
    names = [c.mode for c in bt.round_schedule(cells, 3)]
    assert names == ["baton", "eager_async", "eager_async", "baton", "baton", "eager_async"]
    assert bt.round_schedule(cells, 1) == cells
    assert bt.parse_args(["--rounds", "2"]).rounds == 2
    with pytest.raises(SystemExit):
        bt.parse_args(["--rounds", "0"])


def test_quality_is_scored_on_the_answer_before_its_end_of_turn() -> None:
    assert bt.answer_proper("Paris.<|im_end|>\nuser more") == "Paris."
    assert bt.answer_proper("no end yet") == "no end yet"
