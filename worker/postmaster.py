"""What ``/proc`` proves about the Postgres processes of one data directory.

``postmaster.pid`` is only a claim: it can be empty, truncated, or name a recycled pid. The
processes themselves are the evidence. A process belongs to a data directory when it is a
live (non-zombie) postgres process whose cwd is that directory. Among those,

- the **postmaster** is the one whose parent is not another process of the same directory
  and which still carries its command line (``.../postgres -D ...``), not a child's title
  (``postgres: checkpointer``); it alone holds the listening socket;
- an **orphan** is a child (titled ``postgres: ...``) whose parent is not a process of the
  directory: its postmaster is gone. Only orphans, and only while no postmaster of the
  directory is alive, may ever be signalled.

Nothing here signals or writes anything; :mod:`worker.embedded` decides.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from worker import files

_TITLE = b"postgres:"  # how every child of a postmaster renames itself
_TCP_LISTEN = "0A"
_LOOPBACK_HEX = "0100007F"  # 127.0.0.1 as /proc/net/tcp prints it (little-endian)
READY = "ready   "  # the status line as Postgres writes it (PM_STATUS_READY)


@dataclass(frozen=True, slots=True)
class PidFile:
    pid: int  # 0 when the file is empty or garbled
    port: int | None
    status: str  # "starting", "stopping", "ready", "standby" or "" (absent, truncated)


@dataclass(frozen=True, slots=True)
class Proc:
    ppid: int
    titled: bool  # renamed itself "postgres: ...": a child of a postmaster, never one


def read_pidfile(datadir: Path) -> PidFile | None:
    """The parsed ``postmaster.pid``; None when it is missing or unreadable, or not a regular
    file (read without following a link: the server's user owns the directory)."""
    text = files.read_regular(datadir / "postmaster.pid", limit=4096)
    if text is None:
        return None
    lines = text.splitlines()
    pid = int(lines[0]) if lines and lines[0].strip().isdigit() else 0
    port = int(lines[3]) if len(lines) > 3 and lines[3].strip().isdigit() else None
    return PidFile(pid, port, lines[7].strip() if len(lines) > 7 else "")


def pidfile_text(
    *, pid: int, datadir: Path, started: int, port: int, shm: tuple[int, int] | None
) -> str:
    """``postmaster.pid`` of a ready server listening on 127.0.0.1 with no unix socket, laid
    out as Postgres writes it (``miscadmin.h``, ``LOCK_FILE_LINE_*``). ``started`` may be a
    second off the one Postgres wrote; pg_ctl, its only reader, allows for that."""
    key, shmid = shm or (0, 0)
    lines = [str(pid), str(datadir), str(started), str(port), "", "127.0.0.1"]
    return "\n".join([*lines, f"{key:9d} {shmid:9d}", READY]) + "\n"


def processes(datadir: Path) -> dict[int, Proc]:
    """Every live postgres process whose cwd is ``datadir``, by pid."""
    target, found = os.path.realpath(datadir), {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (proc := _proc(int(entry), target)) is not None:
            found[int(entry)] = proc
    return found


def is_postmaster(pid: int, datadir: Path, procs: dict[int, Proc] | None = None) -> bool:
    """Whether ``pid`` is the live postmaster of ``datadir``."""
    procs = processes(datadir) if procs is None else procs
    proc = procs.get(pid)
    return proc is not None and not proc.titled and proc.ppid not in procs


def find_postmaster(datadir: Path, procs: dict[int, Proc] | None = None) -> int | None:
    """The pid of the live postmaster of ``datadir``, whatever its pid file says."""
    procs = processes(datadir) if procs is None else procs
    heads = sorted(pid for pid in procs if is_postmaster(pid, datadir, procs))
    # Postgres's own interlocks allow one postmaster per data directory; were there two,
    # either is alive and neither may be treated as gone.
    return heads[0] if heads else None


def orphans(datadir: Path) -> list[int]:
    """Children of a dead postmaster of ``datadir``; empty while any postmaster of it lives."""
    procs = processes(datadir)
    if find_postmaster(datadir, procs) is not None:
        return []
    return sorted(
        pid
        for pid, proc in procs.items()
        if proc.titled and proc.ppid not in procs and not listen_ports(pid)
    )


def listen_ports(pid: int) -> list[int]:
    """Ports ``pid`` listens on at 127.0.0.1 (its socket fds matched to /proc/net/tcp)."""
    try:
        inodes = {
            link[len("socket:[") : -1]
            for fd in os.listdir(f"/proc/{pid}/fd")
            if (link := _readlink(f"/proc/{pid}/fd/{fd}")).startswith("socket:[")
        }
        table = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return []
    ports = []
    for row in table:
        fields = row.split()
        if len(fields) < 10 or fields[3] != _TCP_LISTEN or fields[9] not in inodes:
            continue
        address, _, port = fields[1].partition(":")
        if address == _LOOPBACK_HEX:
            ports.append(int(port, 16))
    return sorted(ports)


def shm_segment(pid: int) -> tuple[int, int] | None:
    """(key, shmid) of the System V segment ``pid`` created (the postmaster's interlock)."""
    try:
        table = Path("/proc/sysvipc/shm").read_text()
    except OSError:
        return None
    try:
        maps: str | None = Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # another user's process, unless we are root
        maps = None
    return segment_of(pid, table, maps)


_SYSV_MAP = re.compile(r"/SYSV([0-9a-f]{8})\b")


def segment_of(pid: int, table: str, maps: str | None) -> tuple[int, int] | None:
    """The segment of ``table`` (``/proc/sysvipc/shm``) that ``pid`` created and still has
    mapped (``maps``, its ``/proc/<pid>/maps``; None when unreadable). A segment outlives
    a killed postmaster, and its creator's pid is reused: the one this process maps is its
    own. Without its maps, the one with the most attachments (a leftover has none)."""
    rows = table.splitlines()
    header = rows[0].split() if rows else []
    if not {"key", "shmid", "cpid", "nattch"} <= set(header):
        return None
    at = {name: header.index(name) for name in ("key", "shmid", "cpid", "nattch")}
    mapped = {int(k, 16) for k in _SYSV_MAP.findall(maps)} if maps is not None else None
    found: list[tuple[int, int, int]] = []
    for row in rows[1:]:
        fields = row.split()
        if len(fields) != len(header) or fields[at["cpid"]] != str(pid):
            continue
        key, shmid = int(fields[at["key"]]), int(fields[at["shmid"]])
        if mapped is None or key in mapped:
            found.append((int(fields[at["nattch"]]), key, shmid))
    if not found:
        return None
    _, key, shmid = max(found)
    return key, shmid


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _proc(pid: int, target: str) -> Proc | None:
    try:
        if os.readlink(f"/proc/{pid}/cwd") != target:
            return None
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return None
    if len(fields) < 2 or fields[0] in ("Z", "X") or b"postgres" not in cmdline:
        return None
    return Proc(ppid=int(fields[1]), titled=cmdline.startswith(_TITLE))


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
