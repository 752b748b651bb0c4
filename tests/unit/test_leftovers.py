"""A test session fails when it leaves a process running, and kills what a killed session
left (tests/leftovers.py, wired in tests/conftest.py).

Each case runs a small pytest session of its own, in a subprocess, with this project's
conftest as a plugin, on a test file in a temporary directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import leftovers

ROOT = Path(__file__).resolve().parents[2]

LEAVES_A_SLEEPER = """
import subprocess, sys

def test_starts_a_process_and_forgets_it(tmp_path):
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    (tmp_path.parent.parent / "sleeper.pid").write_text(str(proc.pid))
"""

CLEANS_UP = """
import subprocess

def test_starts_a_process_and_stops_it():
    proc = subprocess.Popen(["sleep", "300"])
    proc.kill()
    proc.wait()
"""


def _session(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    test = tmp_path / "case" / "test_case.py"
    test.parent.mkdir()
    test.write_text(body)
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORKER_TEST_LEFTOVER_GRACE_S="1")
    env.pop(leftovers.MARK, None)
    env.pop("CI", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-c",
            os.devnull,
            "--rootdir",
            str(test.parent),
            "--basetemp",
            str(tmp_path / "base"),
            "-q",
            str(test),
        ],
        cwd=test.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _running(pid: int) -> bool:
    return leftovers._start_time(pid) is not None


def wait_for(check: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_session_that_leaves_a_process_fails_and_kills_it(tmp_path: Path) -> None:
    proc = _session(tmp_path, LEAVES_A_SLEEPER)
    out, _ = proc.communicate(timeout=120)
    pid = int((tmp_path / "sleeper.pid").read_text())
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "left 1 process(es) running" in out and "sleep 300" in out, out
    wait_for(lambda: not _running(pid), timeout=10, what=f"sleeper {pid} killed")


def test_a_session_that_stops_what_it_started_passes(tmp_path: Path) -> None:
    proc = _session(tmp_path, CLEANS_UP)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "process(es) running" not in out, out


def test_what_a_killed_session_left_is_swept(tmp_path: Path) -> None:
    body = LEAVES_A_SLEEPER.replace(
        "write_text(str(proc.pid))", "write_text(str(proc.pid))\n    import time; time.sleep(300)"
    )
    proc = _session(tmp_path, body)
    marker = tmp_path / "sleeper.pid"
    # The file exists from its open on; the pid is in it once written.
    wait_for(
        lambda: marker.exists() and marker.read_text().strip() != "",
        timeout=60,
        what="the session started its process",
    )
    pid = int(marker.read_text())
    proc.send_signal(signal.SIGKILL)  # no fixture, no hook of that session runs
    proc.communicate(timeout=30)
    assert _running(pid)
    swept = leftovers.sweep_orphans()
    assert pid in {m.pid for m in swept}, swept
    wait_for(lambda: not _running(pid), timeout=10, what=f"orphan {pid} killed")


def test_a_reused_pid_is_not_the_session() -> None:
    pid, _, started = leftovers.session_mark().partition(":")
    assert leftovers._alive(f"{pid}:{started}")
    assert not leftovers._alive(f"{pid}:{int(started) + 1}")
