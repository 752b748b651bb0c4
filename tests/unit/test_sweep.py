"""The sweep of leaked test servers (tests/conftest.py) removes the homes of sessions that
are gone and leaves alone a home another session is still making: under ``pytest -n``
sessions start together, and a home without its owner file yet is not a leak."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests import conftest


def home() -> Path:
    conftest.SWEEP_ROOT.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="sweep-test-", dir=conftest.SWEEP_ROOT))


def dead_pid() -> int:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(child.stdout)


def test_a_home_being_made_is_left_and_a_dead_sessions_is_swept() -> None:
    making, dead, alive = home(), home(), home()
    (dead / "owner.pid").write_text(str(dead_pid()))
    (alive / "owner.pid").write_text(str(os.getpid()))
    try:
        conftest._sweep_leaked()
        assert making.exists()  # no owner file yet, and young
        assert alive.exists()
        assert not dead.exists()
        old = conftest.UNOWNED_GRACE_S + 60
        os.utime(making, (making.stat().st_atime - old, making.stat().st_mtime - old))
        conftest._sweep_leaked()
        assert not making.exists()  # unowned and old: a leak
    finally:
        for path in (making, dead, alive):
            if path.exists():
                for child in path.iterdir():
                    child.unlink()
                path.rmdir()
