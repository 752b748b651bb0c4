"""The schema window's cost bench runs as its users run it, and its counts hold the
promise: an admission-only submit is one statement whether the database is at this code's
schema or at a newer release's (the window adds no round trip to a submit), a memoized
admitter's submit too, and a process's one check reads the history only when the
database is newer."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benches import run_bench


def test_the_window_adds_no_statement_to_a_submit(tmp_path: Path) -> None:
    out = tmp_path / "window.json"
    run_bench("window", "--rounds", "5", "--out", str(out), timeout=120)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"exact", "newer"}
    for state in ("exact", "newer"):
        rows = results[state]
        assert rows["select_1 (baseline)"]["statements"] == 1
        assert rows["submit, admission-only"]["statements"] == 1, state
        assert rows["submit, same admitter (memoized)"]["statements"] == 1, state
    # One check per process: the record alone at this code's schema, and the history once
    # more inside the window.
    assert results["exact"]["schema check"]["statements"] == 2
    assert results["newer"]["schema check"]["statements"] == 3
    first = "submit, new admitter (check, prepare, insert)"
    assert results["newer"][first]["statements"] == results["exact"][first]["statements"] + 1
