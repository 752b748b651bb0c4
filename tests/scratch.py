"""Where tests put the data directories of the Postgres servers they start.

In RAM (``/dev/shm``) when it is a RAM file system with room, else the temporary directory:
the servers are thrown away after their session or test, and nothing a test checks
depends on the file system (a SIGKILLed postmaster's writes are the kernel's either way).
In RAM a commit's WAL flush, initdb's syncs, a base backup, a copy and a removal cost a
fraction of what they cost on a disk. The servers keep every default setting
(``fsync``, ``synchronous_commit``): only the medium changes.

Everything goes under :data:`ROOT`, which the session start sweeps (tests/conftest.py): a
directory a killed session left is removed, and its server stopped.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

ROOM = 1 << 30  # a RAM file system with less free space than this is not used


def _base() -> Path:
    with contextlib.suppress(OSError):
        shm = os.statvfs("/dev/shm")
        if shm.f_bavail * shm.f_frsize >= ROOM:
            return Path("/dev/shm")
    return Path(tempfile.gettempdir())


ROOT = _base() / "worker-tests"


def scratch() -> str:
    """:data:`ROOT`, made if missing (readable by the servers' own user)."""
    ROOT.mkdir(parents=True, exist_ok=True)
    ROOT.chmod(0o755)
    return str(ROOT)
