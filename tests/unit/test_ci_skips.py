"""In CI a skipped test fails with its reason (tests/conftest.py); elsewhere it skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(tmp: Path, ci: str) -> subprocess.CompletedProcess[str]:
    folder = tmp / "tests_probe"
    folder.mkdir(exist_ok=True)
    (folder / "conftest.py").write_text(
        (ROOT / "tests" / "conftest.py").read_text(encoding="utf-8"), encoding="utf-8"
    )
    (folder / "test_probe.py").write_text(
        "import pytest\n\n\ndef test_needs_a_mechanism():\n    pytest.skip('no bwrap here')\n",
        encoding="utf-8",
    )
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_skip_fails_in_ci_with_its_reason(tmp_path: Path) -> None:
    failed = run(tmp_path, "true")
    assert failed.returncode == 1, failed.stdout
    assert "skipped in CI, which must run it" in failed.stdout and "no bwrap here" in failed.stdout


def test_a_skip_stays_a_skip_outside_ci(tmp_path: Path) -> None:
    skipped = run(tmp_path, "")
    assert skipped.returncode == 0, skipped.stdout
    assert "1 skipped" in skipped.stdout
