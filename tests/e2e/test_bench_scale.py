"""A smoke run of ``python -m bench.scale``: one host, a few runs, and the ``--json``
contract (the last line is ``{"rows": [...]}`` with the documented keys)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benches import run_bench


def test_bench_scale_prints_its_rows_as_the_last_json_line(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    done = run_bench(
        "scale",
        *("--hosts", "1", "--trivial-runs", "40", "--io-rounds", "5", "--loopback", "--json"),
        *("--out", str(out)),
        timeout=300,
    )
    assert json.loads(out.read_text())["bench"] == "scale"
    last = done.stdout.strip().splitlines()[-1]
    [row] = json.loads(last)["rows"]
    assert row["hosts"] == 1 and row["network"] == "loopback"
    assert row["io_runs"] == 5 * 2 and row["io_runs_per_s"] > 0
    assert row["trivial_runs_per_s"] > 0 and 0 < row["connections"] <= 10
    assert row["pickup_p50_ms"] > 0
    assert "separate processes on loopback" in done.stderr
