"""The Procfile's worker serves the release the submits use: it passes no ``--release``,
so ``worker start`` takes the documented default (``WORKER_RELEASE``, else the platform's
commit variable, else ``dev``), the same one ``worker submit`` takes."""

from __future__ import annotations

import shlex
from pathlib import Path

from worker import config

ROOT = Path(__file__).resolve().parents[2]


def test_the_procfile_worker_takes_the_default_release() -> None:
    lines = dict(
        line.split(":", 1) for line in (ROOT / "Procfile").read_text().splitlines() if line
    )
    words = shlex.split(lines["worker"])
    assert words[:3] == ["exec", "worker", "start"]
    assert not any(w == "--release" or w.startswith("--release=") for w in words), words
    # With only a platform's commit set, the worker and the submits agree on it.
    heroku = {"HEROKU_SLUG_COMMIT": "0123456789abcdef0123"}
    assert config.default_release(heroku) == "0123456789ab"
