"""Nothing a test session starts outlives it.

Every process a test starts (workers, recovery loops, benchmarks, throwaway Postgres
servers, browsers, PgBouncer) inherits the session's mark, ``WORKER_TEST_SESSION``: the
pid and start time of the pytest process that runs it, so a later process reusing the pid
is never taken for it. Postgres servers keep their environment, and so does everything
else this project starts, whatever user it runs as.

- At the start of a session, processes whose session is gone (a pytest that was killed,
  its fixtures never run) are killed: they would hold ports, memory and locks, and a
  server left running would be found by the next session's sweep of its own directory
  only.
- At the end of a session, processes of this session still alive after a grace period
  (a server stopping, a worker finishing its shutdown) are killed, and the session fails
  naming them: a test that leaves a process behind is a defect.

Linux only (``/proc``); elsewhere both checks find nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

MARK = "WORKER_TEST_SESSION"
PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class Marked:
    """A live process carrying a session's mark."""

    pid: int
    session: str
    command: str


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of its stat)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited: nothing of it runs
        return None
    return fields[19]


def session_mark(pid: int | None = None) -> str:
    """The mark of the session run by ``pid`` (this process by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_time(pid)}"


def _alive(mark: str) -> bool:
    pid, _, started = mark.partition(":")
    return pid.isdigit() and _start_time(int(pid)) == started


def marked() -> list[Marked]:
    """Every live process (this one aside) that carries a session mark."""
    found: list[Marked] = []
    if not PROC.is_dir():
        return found
    key = MARK.encode() + b"="
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").strip()
        except OSError:
            continue
        for var in environ.split(b"\0"):
            if var.startswith(key) and _start_time(int(entry.name)) is not None:
                found.append(
                    Marked(
                        int(entry.name),
                        var[len(key) :].decode(errors="replace"),
                        command.decode(errors="replace")[:200],
                    )
                )
                break
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone meanwhile
            os.kill(pid, signal.SIGKILL)


def sweep_orphans() -> list[Marked]:
    """Kill the processes of sessions that are gone; returns them."""
    orphans = [m for m in marked() if not _alive(m.session)]
    _kill([m.pid for m in orphans])
    return orphans


def left_behind(mark: str, *, grace_s: float = 15.0) -> list[Marked]:
    """The processes of the session ``mark`` still alive after ``grace_s``, killed."""
    deadline = time.monotonic() + grace_s
    while True:
        mine = [m for m in marked() if m.session == mark]
        if not mine or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    _kill([m.pid for m in mine])
    return mine
