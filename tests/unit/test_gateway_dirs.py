"""A worker's private gateway directory names its process, and the next worker removes
those of processes that are gone: a SIGKILLed worker never removes its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from worker import gateway


def dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def test_the_directories_of_gone_processes_are_removed(tmp_path: Path) -> None:
    gone = tmp_path / f"wq-gateway-{dead_pid()}-abc"
    live = tmp_path / f"wq-gateway-{os.getpid()}-def"
    older = tmp_path / "wq-gateway-12345678"  # another release's name: left alone
    other = tmp_path / "something-else"
    for path in (gone, live, older, other):
        path.mkdir()
    (gone / "gateway.sock").write_text("")

    assert gateway.sweep_private_dirs(str(tmp_path)) == [str(gone)]
    assert not gone.exists()
    assert live.exists() and older.exists() and other.exists()
