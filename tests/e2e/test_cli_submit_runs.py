"""``worker submit --runs FILE``: a JSONL batch admitted in statements of 1,000, each run
idempotent, every line checked before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg

WORKER = str(Path(sys.executable).parent / "worker")


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [WORKER, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def runs_on(url: str, lane: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM wq_runs WHERE lane = %s", (lane,)).fetchone()
    assert row is not None
    return int(row[0])


def test_submit_runs_admits_a_jsonl_batch_idempotently(db_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "WORKER_APP", "VERCEL"}}
    env |= {"WORKER_DATABASE_URL": db_url, "WORKER_HOME": str(tmp_path / "home")}
    lines = [{"play": "noop", "params": {"i": i}, "idempotency_key": f"k{i}"} for i in range(1500)]
    lines.append({"play": "noop", "org": "acme", "priority": 3})
    path = tmp_path / "runs.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")

    first = run(env, "submit", "--runs", str(path), "--release", "b1", "--json")
    assert first.returncode == 0, first.stderr
    admitted = json.loads(first.stdout)["runs"]
    assert len(admitted) == 1501 and all(a["created"] for a in admitted)
    assert {a["lane"] for a in admitted} == {"r-b1"}

    # The same file again: the keyed runs answer with their runs, the keyless one is new.
    again = run(env, "submit", "--runs", str(path), "--release", "b1", "--json")
    assert again.returncode == 0, again.stderr
    retried = json.loads(again.stdout)["runs"]
    assert [a["run_id"] for a in retried[:1500]] == [a["run_id"] for a in admitted[:1500]]
    assert [a["created"] for a in retried] == [False] * 1500 + [True]
    assert runs_on(db_url, "r-b1") == 1502


def test_a_bad_line_or_an_unknown_field_writes_nothing(db_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "WORKER_APP", "VERCEL"}}
    env |= {"WORKER_DATABASE_URL": db_url, "WORKER_HOME": str(tmp_path / "home")}
    path = tmp_path / "runs.jsonl"
    path.write_text('{"play": "noop"}\n{"play": "noop", "delay": "5s"}\n')
    refused = run(env, "submit", "--runs", str(path), "--release", "b2")
    assert refused.returncode == 2
    assert "line 2" in refused.stderr and "delay" in refused.stderr
    path.write_text('{"play": "noop"}\n{"play": "noop", "params": [1]}\n')
    refused = run(env, "submit", "--runs", str(path), "--release", "b2")
    assert refused.returncode == 2 and "line 2" in refused.stderr
    both = run(env, "submit", "noop", "--runs", str(path), "--release", "b2")
    assert both.returncode == 2 and "PLAY" in both.stderr
    assert runs_on(db_url, "r-b2") == 0
