"""This checkout built and installed once, for the tests that need it as a user gets it.

Two builds are shared, each made under one lock by whichever test needs it first, so two
``pytest -n`` processes never make the same one twice or read one half made:

- :func:`built_dist`: the sdist and the wheel (tests/e2e/test_wheel.py checks and installs
  them). Made once per test run: each run builds with the build backend the package index
  serves it then, as a user's build would.
- :func:`installed_checkout`: that wheel ``pip install --no-deps --target``-ed into a
  directory (tests/e2e/test_release_window.py runs the new release from copies of it).
  Reused by later runs: it holds the package's files, which the key below determines.

Both are keyed by a digest of the build's inputs, :func:`checkout_digest`: the tree's
top-level files and its package trees (:data:`PACKAGES`), and the interpreter. A change to
any of them makes a new build; a change elsewhere (a test, a doc) does not, and every sdist
built is checked to hold only files the digest covers (and the metadata the build writes),
so the key cannot miss an input the build ships.

They live in a directory of the system's temporary directory, outside the checkout. Each
is built in a temporary directory there, marked complete and renamed into place, so a
killed build leaves nothing a later test would take for a build; an entry unused for a day
is removed by the next build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests import leftovers

ROOT = Path(__file__).resolve().parents[1]
# The trees pyproject.toml's [tool.setuptools] packages are built from.
PACKAGES = ("queues", "worker", "sql")
# What a build of the tree is not given: version control, virtualenvs, caches and the
# outputs of earlier builds (the tree is copied first: a build writes ``build/`` and
# ``*.egg-info`` where it runs).
IGNORED = shutil.ignore_patterns(
    ".git", "v", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".*_cache",
    ".hypothesis", "node_modules",
)  # fmt: skip
CACHE = Path(tempfile.gettempdir()) / f"worker-test-builds-{os.getuid()}"
COMPLETE = ".complete"  # written into an entry last: only a complete entry has it
UNUSED_S = 86400.0  # an entry not used for this long is removed
# What an sdist holds beside its inputs: the metadata the build writes.
SDIST_METADATA = ("PKG-INFO", "setup.cfg", "worker.egg-info/")

# The sdist, then the wheel from the unpacked sdist (so the sdist is checked to be
# complete), as ``python -m build`` makes them, but in one isolated environment where
# ``build`` makes one per distribution and installs the same build backend into each (the
# sdist's pyproject.toml is the tree's: its build-system.requires are installed already).
# The environment still holds only what the build declares (build-system.requires and
# what the backend asks for), so an undeclared build dependency still fails the build.
BUILD = """
import pathlib, sys, tarfile, tempfile
from build import ProjectBuilder
from build.env import DefaultIsolatedEnv

source, out = sys.argv[1], sys.argv[2]
with DefaultIsolatedEnv() as env:
    sdist_builder = ProjectBuilder.from_isolated_env(env, source)
    env.install(sdist_builder.build_system_requires)
    env.install(sdist_builder.get_requires_for_build("sdist"))
    sdist = sdist_builder.build("sdist", out)
    with tempfile.TemporaryDirectory() as unpacked:
        with tarfile.open(sdist) as archive:
            if hasattr(tarfile, "data_filter"):
                archive.extractall(unpacked, filter="data")
            else:
                archive.extractall(unpacked)
        [tree] = pathlib.Path(unpacked).iterdir()
        wheel_builder = ProjectBuilder.from_isolated_env(env, tree)
        env.install(wheel_builder.get_requires_for_build("wheel"))
        wheel_builder.build("wheel", out)
"""


def run(
    command: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``command``, which must exit 0 (else its output's tails fail the test)."""
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, (
        f"`{' '.join(command)}` exited {done.returncode}\n"
        f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    )
    return done


def _inputs(tree: Path) -> list[str]:
    """The build's inputs in ``tree``, relative: the files a copy of it holds (those
    :data:`IGNORED` leaves) at its top level and in its package trees."""
    found = [
        p.name for p in tree.iterdir() if p.is_file() and p.name not in IGNORED(tree, [p.name])
    ]
    for package in PACKAGES:
        for folder, dirs, files in os.walk(tree / package):
            dirs[:] = [d for d in dirs if d not in IGNORED(folder, dirs)]
            kept = set(files) - IGNORED(folder, files)
            found += [(Path(folder) / f).relative_to(tree).as_posix() for f in kept]
    return sorted(found)


def checkout_digest(tree: Path = ROOT) -> str:
    """A digest of the build's inputs in ``tree`` (see the module) and of the interpreter."""
    digest = hashlib.sha256(f"{sys.executable}\0{sys.version}\0".encode())
    for relative in _inputs(tree):
        digest.update(f"{relative}\0".encode())
        digest.update(hashlib.sha256((tree / relative).read_bytes()).digest())
    return digest.hexdigest()[:20]


def run_id() -> str:
    """This test run's id: the one of all its ``pytest -n`` processes, else its session's."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or os.environ.get(leftovers.MARK, "")
    return hashlib.sha256(run.encode()).hexdigest()[:12]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The cache's lock: held while an entry is looked up, built or removed."""
    CACHE.mkdir(mode=0o700, parents=True, exist_ok=True)
    with (CACHE / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _found(name: str) -> Path | None:
    """The complete entry ``name``, marked used now; ``None`` if there is none (the cache
    is locked)."""
    entry = CACHE / name
    if not (entry / COMPLETE).is_file():
        return None
    os.utime(entry)
    return entry


def _prune() -> None:
    """Remove the entries unused for :data:`UNUSED_S` and the builds that never completed
    (the cache is locked: no build is under way). An entry in use was marked used when it
    was looked up, so it is not removed under a test that reads it."""
    for entry in CACHE.iterdir():
        if entry.name == ".lock":
            continue
        try:
            unused_s = time.time() - entry.stat().st_mtime
        except OSError:
            continue
        if ".tmp-" in entry.name or unused_s > UNUSED_S:
            shutil.rmtree(entry, ignore_errors=True)


def _entry(name: str, make: Callable[[Path], None]) -> Path:
    """The entry ``name``: made by ``make(directory)`` unless complete already."""
    with _locked():
        found = _found(name)
        if found is not None:
            return found
        _prune()
        building = Path(tempfile.mkdtemp(prefix=f"{name}.tmp-", dir=CACHE))
        try:
            make(building)
            (building / COMPLETE).write_text(f"{time.time()}\n")
            building.rename(CACHE / name)
        finally:
            shutil.rmtree(building, ignore_errors=True)
        return CACHE / name


@dataclass(frozen=True)
class Dist:
    sdist: Path | None  # None when ``build`` is not installed (``pip wheel`` made the wheel)
    wheel: Path


def _check_sdist(sdist: Path, inputs: list[str]) -> None:
    """The sdist holds the build's inputs it ships and the build's metadata, nothing else:
    a file the build takes from outside the digested inputs would make the key miss it."""
    with tarfile.open(sdist) as archive:
        members = [m.name.partition("/")[2] for m in archive.getmembers() if m.isfile()]
    others = [
        m
        for m in members
        if m not in inputs and not any(m == x or m.startswith(x) for x in SDIST_METADATA)
    ]
    assert not others, (
        f"{sdist.name} holds files outside tests/releases.py's PACKAGES and top-level files, "
        f"which key its cache: {others}"
    )


def _builder(digest: str) -> Callable[[Path], None]:
    def build(into: Path) -> None:
        """The sdist and the wheel of a copy of the tree into ``into/dist``, with
        ``build``; the wheel alone, with ``pip wheel``, when ``build`` is not installed."""
        tree, dist = into / "tree", into / "dist"
        shutil.copytree(ROOT, tree, ignore=IGNORED, symlinks=True)
        assert checkout_digest(tree) == digest, "the checkout changed while it was copied"
        if importlib.util.find_spec("build") is not None:
            run([sys.executable, "-c", BUILD, str(tree), str(dist)], cwd=tree, timeout=240)
            [sdist] = dist.glob("*.tar.gz")
            _check_sdist(sdist, _inputs(tree))
        else:
            run(
                [
                    *(sys.executable, "-m", "pip", "wheel", "--no-deps"),
                    *("--wheel-dir", str(dist), str(tree)),
                ],
                cwd=tree,
                timeout=240,
            )
        shutil.rmtree(tree)

    return build


def built_dist(digest: str | None = None) -> Dist:
    """This checkout's sdist and wheel, built once per test run (see the module);
    ``digest``: its :func:`checkout_digest`, if the caller has it."""
    digest = digest or checkout_digest()
    entry = _entry(f"dist-{digest}-{run_id()}", _builder(digest))
    built = sorted((entry / "dist").iterdir())
    wheels = [p for p in built if p.suffix == ".whl"]
    sdists = [p for p in built if p.name.endswith(".tar.gz")]
    assert len(wheels) == 1 and len(sdists) <= 1, built
    return Dist(sdists[0] if sdists else None, wheels[0])


def installed_checkout() -> Path:
    """A directory this checkout's wheel is installed into (``pip install --no-deps
    --target``, its modules compiled), built once per :func:`checkout_digest` (see the
    module). Read it, never write it: copy it to change it."""
    digest = checkout_digest()
    name = f"site-{digest}"
    with _locked():
        found = _found(name)
    if found is not None:
        return found / "site"
    wheel = built_dist(digest).wheel  # outside the lock: it takes it

    def install(into: Path) -> None:
        run(
            [
                *(sys.executable, "-m", "pip", "install", "--disable-pip-version-check"),
                *("--no-deps", "--target", str(into / "site"), str(wheel)),
            ],
            cwd=into,
            timeout=300,
        )

    return _entry(name, install) / "site"
