"""A rolling deploy with real worker processes: release v1's workers, then v2's, an
admission-only app on v2, a drain and a reclaim of v1, and a historic v1 sleeper that wakes
after the reclaim.

While both releases' workers run, each idle (waiting for work), runs are queued on both
lanes at once, so every one of them could be taken by either worker: each lane's runs must
run only on its own release's worker.

Every play records the release its worker was started with, and every attempt the id of
the worker that ran it. At the end: no run was executed by a worker of another release
than its own (the one adopted run belongs to v2 once adopted), none was lost, and v1 never
reopened to admissions.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psycopg
import pytest

from queues import runs
from tests.workers import eventually, fetch, together

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(sys.executable).parent / "worker")
APP = "tests.apps.deploy:registry"


def env_for(url: str, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "VERCEL", "WORKER_ADMISSION_ONLY", "WORKER_RELEASE"}
    }
    env.update(WORKER_DATABASE_URL=url, PYTHONPATH=str(ROOT), **extra)
    return env


def cli(url: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [WORKER, *args],
        env=env_for(url, **extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@contextmanager
def worker_of(url: str, release: str, tmp: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A ``worker start`` process of ``release`` that reported ready, and its worker id."""
    ready = tmp / f"{release}-{uuid.uuid4().hex[:6]}.ready"
    with (tmp / f"{release}.log").open("ab") as log:
        proc = subprocess.Popen(
            [
                WORKER,
                "start",
                "--release",
                release,
                "--app",
                APP,
                "--ready-file",
                str(ready),
                "--grace",
                "2",
            ],
            env=env_for(url, DEPLOY_RELEASE=release),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, (tmp / f"{release}.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "worker never reported ready"
            time.sleep(0.05)
        yield proc, str(json.loads(ready.read_text())["worker_id"])
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def submit(url: str, play: str, release: str, *, admission_only: bool, **params: str) -> str:
    extra = {"WORKER_ADMISSION_ONLY": "1"} if admission_only else {}
    args = ["submit", play, "--release", release, "--json"]
    if params:
        args += ["--params", json.dumps(params)]
    done = cli(url, *args, **extra)
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["run_id"])


def submit_batch(url: str, tmp: Path, runs: list[tuple[str, str]]) -> list[str]:
    """Admit ``runs`` (play, release) in one atomic statement (``worker submit --runs``)."""
    batch = tmp / f"batch-{uuid.uuid4().hex[:6]}.jsonl"
    batch.write_text("".join(json.dumps({"play": p, "release": r}) + "\n" for p, r in runs))
    done = cli(url, "submit", "--runs", str(batch), "--json")
    assert done.returncode == 0, done.stderr
    return [str(run["run_id"]) for run in json.loads(done.stdout)["runs"]]


async def waiting_for_work(url: str, worker_id: str) -> bool:
    """Whether the worker is idle: in the set of workers waiting for work (its last claim
    came back short)."""
    rows = await fetch(url, "SELECT waiting_since FROM wq_workers WHERE id = %s", (worker_id,))
    return bool(rows) and rows[0][0] is not None


async def ran_on(url: str, run_ids: list[str]) -> dict[str, set[str]]:
    """The ids of the workers that ran an attempt of the runs, by the runs' lane."""
    rows = await fetch(
        url,
        "SELECT r.lane, a.worker_id FROM wq_runs r JOIN wq_attempts a ON a.run_id = r.id"
        " WHERE r.id = ANY(%s::uuid[])",
        (run_ids,),
    )
    found: dict[str, set[str]] = {}
    for lane, worker_id in rows:
        found.setdefault(str(lane), set()).add(str(worker_id))
    return found


async def states(url: str, run_ids: list[str]) -> dict[str, str]:
    rows = await fetch(
        url, "SELECT id::text, state::text FROM wq_runs WHERE id = ANY(%s::uuid[])", (run_ids,)
    )
    return {str(r): str(s) for r, s in rows}


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_rolling_deploy_runs_each_run_on_its_own_release_and_loses_none(
    db_url: str, tmp_path: Path
) -> None:
    assert cli(db_url, "migrate").returncode == 0  # the release phase
    with ExitStack() as stack:
        # v1 is live: its worker, and the old app admitting on v1.
        v1, v1_worker = stack.enter_context(worker_of(db_url, "v1", tmp_path))
        work, sleeper = together(
            functools.partial(submit, db_url, "work", "v1", admission_only=False),
            functools.partial(submit, db_url, "nap", "v1", admission_only=False, event="go"),
        )
        v1_runs = [work]
        await until(db_url, v1_runs, "succeeded")
        await until(db_url, [sleeper], "sleeping")

        # v2 rolls out: its worker starts (and prepares its lane) beside v1's. Both are
        # running and idle, waiting for work; then runs are queued on both lanes at once
        # (one atomic batch, a release per run: the old and the new app admitting in the
        # same moment), so each worker is woken while the other lane's runs are there to
        # take too.
        _, v2_worker = stack.enter_context(worker_of(db_url, "v2", tmp_path))

        async def both_idle() -> bool:
            return await waiting_for_work(db_url, v1_worker) and await waiting_for_work(
                db_url, v2_worker
            )

        await eventually(both_idle, timeout=30)
        overlap = submit_batch(db_url, tmp_path, [("work", r) for r in ("v1", "v2") * 4])
        await until(db_url, overlap, "succeeded")
        # Each lane's runs ran only on its own release's worker.
        assert await ran_on(db_url, overlap) == {"r-v1": {v1_worker}, "r-v2": {v2_worker}}

        # The app switches to v2, in admission-only mode (no lane preparation, no schema
        # check on the app side), while a straggler still admits on v1.
        v2_run, late_v1 = together(
            functools.partial(submit, db_url, "work", "v2", admission_only=True),
            functools.partial(submit, db_url, "work", "v1", admission_only=False),
        )
        v2_runs = [v2_run]
        drained = cli(db_url, "queues", "drain", "v1")
        assert drained.returncode == 0, drained.stderr
        refused = cli(db_url, "submit", "work", "--release", "v1")
        assert refused.returncode == 1 and "error[LANE_DRAINING]" in refused.stderr
        await until(db_url, [*v2_runs, late_v1], "succeeded")  # v1's worker drains v1

        # The deploy is over: v1's worker stops, v1 is reclaimed with the sleeper on it.
        v1.send_signal(signal.SIGTERM)
        assert v1.wait(timeout=30) == 0
        reclaimed = cli(db_url, "queues", "reclaim", "v1", "--force")
        assert reclaimed.returncode == 0, reclaimed.stderr

        # The sleeper's event comes: it wakes on its own, reclaimed lane. No v1 worker
        # serves it, so it is reported stranded; it is not lost, and v1 stays closed.
        assert cli(db_url, "emit", "go").returncode == 0

        # (Reported once it has waited a moment since its wake: the threshold only sets
        # when, and a short one spares the test a second pass.)
        async def stranded() -> bool:
            report = cli(db_url, "recover", "--once", "--json", "--stranded-after", "100ms")
            return report.returncode == 0 and '"lane": "r-v1"' in report.stdout

        await eventually(stranded, timeout=60, interval=0.2)
        refusals = together(
            functools.partial(cli, db_url, "submit", "work", "--release", "v1"),
            functools.partial(
                cli, db_url, "submit", "work", "--release", "v1", WORKER_ADMISSION_ONLY="1"
            ),
        )
        for again in refusals:
            assert again.returncode == 1 and "error[LANE_RECLAIMED]" in again.stderr
        # The operator adopts v1 into v2; v2's worker finishes it.
        adopted = cli(db_url, "queues", "adopt", "v1", "v2")
        assert adopted.returncode == 0, adopted.stderr
        await until(db_url, [sleeper], "succeeded")

    everything = [*v1_runs, sleeper, *overlap, *v2_runs, late_v1]
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        finished = [await runs.get(conn, uuid.UUID(r)) for r in everything]
        lane = await conn.execute("SELECT state::text FROM wq_lanes WHERE name = 'r-v1'")
        assert await lane.fetchone() == ("reclaimed",)
    assert [r.state for r in finished] == ["succeeded"] * len(everything)  # none lost
    wrong = [
        (str(r.id), r.release, r.result["executed_by"])
        for r in finished
        if r.result["executed_by"] != r.release
    ]
    assert wrong == []  # no run executed by a worker of another release than its own
    by_id = {str(r.id): r for r in finished}
    assert {by_id[r].result["executed_by"] for r in [*v1_runs, late_v1]} == {"v1"}
    assert {by_id[r].result["executed_by"] for r in v2_runs} == {"v2"}
    # ... and by its release's one worker process: every attempt of a run on v1's lane by
    # v1's worker, of a run on v2's lane by v2's (the sleeper, adopted, has both).
    unadopted = [r for r in everything if r != sleeper]
    assert await ran_on(db_url, unadopted) == {"r-v1": {v1_worker}, "r-v2": {v2_worker}}
    assert await ran_on(db_url, [sleeper]) == {"r-v2": {v1_worker, v2_worker}}
    # The sleeper slept on v1 and, adopted, was finished by v2 (its release is v2 now).
    assert by_id[sleeper].result["slept_on"] == "v1" and by_id[sleeper].release == "v2"
    assert by_id[sleeper].result["woken"] is True


async def until(url: str, run_ids: list[str], state: str) -> None:
    async def reached() -> bool:
        found = await states(url, run_ids)
        return len(found) == len(run_ids) and all(s == state for s in found.values())

    await eventually(reached, timeout=60)
