"""Running a benchmark module as its users do (``python -m bench.NAME ...``) in a test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(
    module: str, *args: str, timeout: float, code: int = 0
) -> subprocess.CompletedProcess[str]:
    """``python -m bench.<module> args`` from the checkout; it must exit with ``code``."""
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == code, done.stderr[-3000:]
    return done
