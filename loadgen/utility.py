"""Utility table for OnTimeUtility: the value of one answer, per task and model.

The latency-aware routing paper scores a served request by the utility of the
model that answered it for that task (accuracy minus lambda * cost), and counts
it only if its TTFT met the target. The table is a file:

- JSON: `{"<task>": {"<model>": utility, ...}, ...}`
- CSV: header `task,model,utility`

`*` as task or model is a wildcard. Without a table every answer is worth 1, so
OnTimeUtility equals the share of requests served on time.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class UtilityTable:
    """utility[(task, model)] with `*` wildcards; missing entries are worth 0."""

    entries: dict[tuple[str, str], float]

    def lookup(self, task: str, model: str) -> float | None:
        """The utility of `model` answering a `task` request, None if not in the table."""
        for key in ((task, model), (task, "*"), ("*", model), ("*", "*")):
            if key in self.entries:
                return self.entries[key]
        return None


def load_utility_table(path: str | Path) -> UtilityTable:
    """Read a JSON or CSV utility table."""
    file = Path(path)
    entries: dict[tuple[str, str], float] = {}
    if file.suffix.lower() == ".csv":
        with file.open(newline="") as f:
            for row in csv.DictReader(f):
                entries[(row["task"].strip(), row["model"].strip())] = float(row["utility"])
    else:
        data = json.loads(file.read_text())
        for task, per_model in data.items():
            for model, value in per_model.items():
                entries[(str(task), str(model))] = float(value)
    if not entries:
        raise ValueError(f"utility table {path} is empty")
    return UtilityTable(entries)
