"""The wire between the worker and a sandbox (worker.sandbox_wire): a spec reads back as it
was written, a probe's spec carries no attempt, only the two control words are heard, a
play's stray lines never pass for the outcome, and the child's side imports nothing of the
worker's."""

from __future__ import annotations

import subprocess
import sys
import uuid
from datetime import UTC, datetime

from queues.authority import AttemptTokens
from worker import sandbox_wire
from worker.context import RunInfo
from worker.plays import Resources
from worker.sandbox_wire import Attempt, Spec, Status


def test_an_attempts_spec_reads_back_as_written() -> None:
    info = RunInfo(
        run_id=uuid.uuid4(),
        attempt=2,
        org="acme",
        play="score",
        lane="default",
        release="r1",
        worker_id="w-1",
        created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        meta={"source": "upload"},
        resumed=True,
    )
    attempt = Attempt(
        app="tests.apps.sandboxed:registry",
        play="score",
        params={"n": 3},
        cleanup=False,
        info=info,
        tokens=AttemptTokens(executor="e.t", ledger="l.t"),
        socket="/run/worker/gateway.sock",
        max_outage_s=12.5,
    )
    spec = Spec((65534, 65534), Resources(memory=None, cpu_s=10), attempt)
    line = spec.line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert Spec.parse(line) == spec


def test_a_probes_spec_has_no_attempt() -> None:
    spec = Spec(None, Resources())
    assert Spec.parse(spec.line()) == spec
    assert Spec.parse(spec.line()).attempt is None


def test_only_the_control_words_are_heard() -> None:
    assert sandbox_wire.control(sandbox_wire.CANCEL) == b"cancel\n"
    assert sandbox_wire.control_of(b"stop\n") == sandbox_wire.STOP
    assert sandbox_wire.control_of(b" cancel \n") == sandbox_wire.CANCEL
    assert sandbox_wire.control_of(b"rm -rf /\n") is None


def test_the_outcome_is_the_last_line_with_a_status() -> None:
    outcome = sandbox_wire.outcome_line({"status": Status.RETURNED, "result": {"x": 1}})
    lines = [outcome.encode(), b'{"printed": "by the play"}\n', b"{not json\n"]
    assert sandbox_wire.last_outcome(lines) == {"status": "returned", "result": {"x": 1}}
    assert sandbox_wire.last_outcome([b'{"printed": 1}\n']) == sandbox_wire.NO_OUTCOME


def test_the_childs_side_imports_nothing_of_the_workers() -> None:
    code = (
        "import sys, worker.sandbox_child; "
        "print(' '.join(m for m in ('worker.sandbox', 'worker.sandbox_launcher', "
        "'worker.attempt', 'worker.executor', 'worker.runtime', 'worker.config') "
        "if m in sys.modules))"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert ran.stdout.strip() == ""
