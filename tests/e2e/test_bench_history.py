"""A smoke run of ``python -m bench.history``: a tiny history, a small drain and RSS
series, and what it writes (a benchmark that cannot run is a defect: its drain once
called a helper whose signature had changed, and nothing ran it)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benches import run_bench


def test_bench_history_drains_each_history_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "history.json"
    run_bench(
        "history",
        *("--history", "0,500", "--runs", "200", "--rss-runs", "400", "--rss-every", "200"),
        *("--settle-timeout", "0", "--out", str(out)),  # a smoke: no wait for autovacuum
        timeout=420,
    )
    results = json.loads(out.read_text())["results"]
    histories = results["histories"]
    assert [h["history"] for h in histories] == [0, 500]
    for h in histories:
        assert h["drain"]["n"] == 200 and h["drain"]["per_s"] > 0
        # Retention deleted nothing: the history, its 100 real runs and the drained ones.
        assert h["runs_after"] == {
            "total": h["history_runs"] + 200,
            "succeeded": h["history_runs"] + 200,
        }
    rss = results["rss"]
    assert rss["runs"] == 400 and [s["runs"] for s in rss["samples"]] == [0, 200, 400]
    assert all(s["VmRSS"] > 0 for s in rss["samples"])
