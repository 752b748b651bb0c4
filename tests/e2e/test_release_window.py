"""The schema compatibility window, with real processes of two releases on one database.

The *previous* release is this project at its latest release: the newest tag ``vX.Y.Z``
reachable from HEAD, else the newest commit whose message is exactly ``Release X.Y.Z``.
With neither (a shallow clone without tags, say) the test fails and says so. Override:

- ``WORKER_PREVIOUS_RELEASE=<git ref>``: the commit it names;
- ``WORKER_PREVIOUS_RELEASE=dir:/path/to/tree``: a source tree on disk, e.g. a copy of the
  work tree while preparing a release (its venv is cached under a digest of its files).

Its source is extracted (``git archive``) into a temporary directory and installed, with its
dependencies, into a venv cached in ``$XDG_CACHE_HOME/worker-tests/releases/<commit>``
(``~/.cache`` when unset). The venv is built in a temporary directory next to it under a
lock and renamed into place once complete, so a killed run never leaves half a venv that a
later one reuses. A venv that moved keeps working, but its scripts' ``#!`` lines do not:
its ``worker`` is always run as ``<venv>/bin/python <venv>/bin/worker``.

The *new* release is this checkout plus one probe migration numbered after its highest: a
``-- kind: expand`` one (a table ``wq_window_probe``; the checkout's trailing contract steps
are left out then) or a ``-- kind: contract`` one (a comment). This checkout's wheel is
installed with ``pip install --no-deps --target`` once per checkout, shared by both
scenarios (tests/releases.py, under a lock); each scenario copies that directory, writes its
probe migration into the copy's ``queues/sql/migrations`` (where the installed package reads
its migrations) and runs it with the copy first on ``PYTHONPATH``, ahead of this checkout's
editable install; a probe process checks that the code it runs is the copy, with the probe
migration as its highest. The installed directory is made in the background from the
module's start, and each copy while the old release's lane is set up.

Both releases serve the plays of ``tests.release.plays`` from their own tree, and the old
release's own smoke scenario (``python -m tests.release.smoke``) runs against the database
the new release migrated. Logs and the commands' transcript (``cli.log``) are kept in the
test's ``tmp_path``; their tails are in every assertion message.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from tests import releases
from tests.workers import together

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]
OVERRIDE = "WORKER_PREVIOUS_RELEASE"
APP = "tests.release.plays:registry"
OLD, NEW = "old", "new"  # the releases' names (their lanes: r-old, r-new)
OLD_LANE = f"r-{OLD}"
# The lanes' policy: a SIGKILLed worker's lease lapses within seconds and a rescued run is
# retried at once (the smoke scenario sets the same on its lane).
POLICY = ("--lease-ttl", "3s", "--heartbeat", "0.5s", "--retry-base", "0s")
HELD = 3  # old runs held inside a step while the window is exercised
GATE = "release-held"  # the file that lets the held runs go on
COMPLETE = ".complete"  # written into a cached venv last: only a complete venv has it
INSTALLED = ("queues", "worker", "sql", "pyproject.toml", "README.md", "LICENSE")
SCRUBBED = {
    "DATABASE_URL",
    "WORKER_MIGRATE_DATABASE_URL",
    "WORKER_ADMISSION_DATABASE_URL",
    "WORKER_READER_DATABASE_URL",
    "WORKER_LISTEN_URL",
    "WORKER_ADMISSION_ONLY",
    "VERCEL",
    "WORKER_RELEASE",
    "WORKER_APP",
    "PYTHONPATH",
}
PROBE = """
import json, importlib.resources, queues.migrations as m, worker.cli as c
print(json.dumps({
    "migrations": m.__file__,
    "cli": c.__file__,
    "sql": str(importlib.resources.files("queues.sql")),
    "highest": max(x.number for x in m.code_migrations()),
}))
"""
_RELEASE_TAG = re.compile(r"v\d+\.\d+\.\d+")
_RELEASE_MESSAGE = re.compile(r"Release \d+\.\d+\.\d+")
_MIGRATION = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


# ---- the previous release --------------------------------------------------------------


@dataclass(frozen=True)
class Previous:
    label: str  # for messages: "v0.2.0 (1a2b3c4d5e6f)", "the tree /path"
    key: str  # the venv cache's key: the commit, or dir-<digest of the installed files>
    commit: str | None = None
    directory: Path | None = None


def _git(*args: str) -> str | None:
    done = subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    return done.stdout.strip() if done.returncode == 0 else None


def _commit_of(ref: str) -> str | None:
    return _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}") or None


def _tree_digest(tree: Path) -> str:
    """A digest of what ``pip install TREE`` installs (the files of :data:`INSTALLED`)."""
    digest = hashlib.sha256()
    for name in INSTALLED:
        top = tree / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            if "__pycache__" in path.parts:
                continue
            digest.update(f"{path.relative_to(tree)}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def resolve_previous() -> Previous:
    """The release before this code (see the module's docstring); fails, never skips."""
    override = os.environ.get(OVERRIDE, "").strip()
    if override.startswith("dir:"):
        path = Path(override[4:]).expanduser().resolve()
        if not (path / "pyproject.toml").is_file():
            pytest.fail(f"{OVERRIDE}={override}: {path} is not a source tree (no pyproject.toml)")
        return Previous(f"the tree {path}", f"dir-{_tree_digest(path)}", directory=path)
    if override:
        commit = _commit_of(override)
        if commit is None:
            pytest.fail(f"{OVERRIDE}={override} names no commit of {ROOT}")
        return Previous(f"{override} ({commit[:12]})", commit, commit=commit)
    if _git("rev-parse", "--git-dir") is None:
        pytest.fail(
            f"{ROOT} is not a git clone, so its previous release cannot be found: set "
            f"{OVERRIDE} to a git ref or to dir:/path/of/its/tree"
        )
    tags = (_git("tag", "--merged", "HEAD", "--sort=-v:refname", "--list", "v*") or "").split()
    # Newest first; only a release's own tag counts (v1.2.3, not vfoo or v1.2.3-rc1).
    for tag in tags:
        if _RELEASE_TAG.fullmatch(tag):
            commit = _commit_of(tag)
            assert commit is not None, tag
            return Previous(f"{tag} ({commit[:12]})", commit, commit=commit)
    # No tag: the newest commit whose whole message is "Release X.Y.Z".
    log = _git(
        "log",
        "-E",
        "--grep",
        r"^Release [0-9]+\.[0-9]+\.[0-9]+$",
        "--format=%H%x1f%B%x1e",
    )
    for entry in (log or "").split("\x1e"):
        commit, _, message = entry.strip().partition("\x1f")
        if commit and _RELEASE_MESSAGE.fullmatch(message.strip()):
            return Previous(f"{message.strip()!r} ({commit[:12]})", commit, commit=commit)
    pytest.fail(
        "no previous release to test against: no tag vX.Y.Z is reachable from HEAD and no "
        "commit's message is 'Release X.Y.Z' (a shallow clone or one without tags: run "
        f"`git fetch --tags --unshallow`), and {OVERRIDE} is not set"
    )


def extract(previous: Previous, dest: Path) -> None:
    """The previous release's source tree into ``dest`` (which exists and is empty)."""
    if previous.directory is not None:
        shutil.copytree(
            previous.directory,
            dest,
            dirs_exist_ok=True,
            symlinks=True,
            ignore=shutil.ignore_patterns(
                ".git", "v", ".venv", "__pycache__", "*.egg-info", "build", ".*_cache"
            ),
        )
        return
    assert previous.commit is not None
    with tempfile.TemporaryFile() as tar:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", previous.commit],
            cwd=ROOT,
            stdout=tar,
            stderr=subprocess.PIPE,
            timeout=120,
            check=False,
        )
        assert archive.returncode == 0, archive.stderr.decode(errors="replace")
        tar.seek(0)
        untar = subprocess.run(
            ["tar", "-x", "-C", str(dest)],
            stdin=tar,
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert untar.returncode == 0, untar.stderr.decode(errors="replace")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "worker-tests" / "releases"


def _logged(command: Sequence[str], log: Path, *, timeout: float, **kw: Any) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False, **kw
        )
    assert done.returncode == 0, f"`{' '.join(command)}` exited {done.returncode}:\n" + tail(
        log, 4000
    )


def _usable(venv: Path) -> bool:
    if not (venv / COMPLETE).is_file():
        return False
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import worker.cli, queues.migrations"],
        cwd=venv,
        capture_output=True,
        timeout=120,
        check=False,
    )
    return done.returncode == 0


def release_venv(previous: Previous, tree: Path, log: Path) -> Path:
    """The cached venv with ``tree`` installed (and its dependencies), built once per key."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / previous.key
    with (root / f"{previous.key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session building the same one: wait
        if _usable(final):
            return final
        # Nothing half-built is reused: a venv without its mark, or the temporary
        # directory of a build that was killed, is removed here, under the lock.
        shutil.rmtree(final, ignore_errors=True)
        for stale in root.glob(f"{previous.key}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        building = Path(tempfile.mkdtemp(prefix=f"{previous.key}.tmp-", dir=root))
        try:
            _logged([sys.executable, "-m", "venv", str(building)], log, timeout=300)
            python = str(building / "bin" / "python")
            _logged(
                [python, "-m", "pip", "install", "--disable-pip-version-check", str(tree)],
                log,
                timeout=900,
                cwd=tree.parent,
            )
            building.chmod(0o755)  # mkdtemp made it private
            (building / COMPLETE).write_text(
                json.dumps({"release": previous.label, "built_at": time.time()}) + "\n"
            )
            building.rename(final)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    assert _usable(final), f"the venv {final} does not import the release:\n{tail(log)}"
    return final


def probe(command: Sequence[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """Where a release's interpreter finds its code, and its highest migration."""
    done = subprocess.run(
        [*command, "-c", PROBE],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def highest_migration(tree: Path) -> int:
    return highest_in(tree / "sql" / "migrations")


def highest_in(migrations: Path) -> int:
    return max(int(match[1]) for p in migrations.iterdir() if (match := _MIGRATION.match(p.name)))


def app_path(tree: Path, where: Path) -> Path:
    """A directory holding only ``tests`` (a link to ``tree/tests``): on PYTHONPATH it makes
    the release's plays importable without its uninstalled packages shadowing the installed
    ones (the source tree keeps ``sql/`` beside ``queues/``, not inside it)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "tests").symlink_to(tree / "tests", target_is_directory=True)
    return where


@dataclass(frozen=True)
class OldBuild:
    label: str
    tree: Path
    venv: Path
    app: Path
    highest: int
    build_s: float


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> OldBuild:
    previous = resolve_previous()
    base = tmp_path_factory.mktemp("previous")
    tree = base / "src"
    tree.mkdir()
    extract(previous, tree)
    if not (tree / "tests" / "release" / "smoke.py").is_file():
        pytest.fail(f"the previous release, {previous.label}, ships no tests/release/smoke.py")
    began = time.monotonic()
    venv = release_venv(previous, tree, base / "venv-build.log")
    build_s = time.monotonic() - began
    app = app_path(tree, base / "app")
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED} | {"PYTHONPATH": str(app)}
    found = probe([python], env, base)
    assert Path(found["migrations"]).is_relative_to(venv), found  # the installed copy
    assert found["highest"] == highest_migration(tree), found
    return OldBuild(previous.label, tree, venv, app, found["highest"], build_s)


# ---- the new release -------------------------------------------------------------------


@dataclass(frozen=True)
class NewBuild:
    target: Path
    app: Path
    probe_name: str  # the probe migration, e.g. 0035_window_probe


PROBE_SQL = {
    "expand": "-- kind: expand\n"
    "-- The window test's probe: a table no code uses.\n"
    "CREATE TABLE wq_window_probe (id integer PRIMARY KEY);\n",
    "contract": "-- kind: contract\n"
    "-- The window test's probe: its kind is what matters.\n"
    "COMMENT ON TABLE wq_runs IS 'window probe';\n",
}


@pytest.fixture(scope="module")
def installed_checkout() -> Iterator[Future[Path]]:
    """This checkout's installed directory (tests/releases.py), made in the background while
    the previous release and the scenarios' old lanes are set up."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(releases.installed_checkout)


def build_new(tmp: Path, kind: str, installed: Future[Path]) -> NewBuild:
    """This checkout's installed copy plus one probe migration of ``kind``, in a directory.

    For an expand probe, the checkout's trailing contract steps are left out of the copy:
    blocked by the old lane, they would make `worker migrate` refuse the expand probe after
    them (section 4b); the contract scenario keeps them, before its probe."""
    target = tmp / "new-site"
    shutil.copytree(installed.result(), target, symlinks=True)
    migrations = target / "queues" / "sql" / "migrations"
    assert highest_in(migrations) == highest_migration(ROOT), f"{target} is not this checkout's"
    if kind == "expand":
        for step in sorted(migrations.glob("*.sql"), reverse=True):
            if not step.read_text().startswith("-- kind: contract"):
                break
            step.unlink()
    number = highest_in(migrations) + 1
    probe_name = f"{number:04d}_window_probe"
    (migrations / f"{probe_name}.sql").write_text(PROBE_SQL[kind])
    app = app_path(ROOT, tmp / "new-app")
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(app)])
    found = probe([sys.executable], env, tmp)
    # The checkout's editable install must not win: the code run is the probe's copy.
    for where in ("migrations", "cli", "sql"):
        assert Path(found[where]).is_relative_to(target), found
    assert found["highest"] == number, found
    return NewBuild(target, app, probe_name)


# ---- running releases ------------------------------------------------------------------


def tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"({path} is missing)"


def tails(tmp: Path) -> str:
    """The end of every log under ``tmp``: for assertion messages."""
    parts = [
        f"--- {p.relative_to(tmp)} ---\n{tail(p, 2500 if p.name == 'cli.log' else 1500)}"
        for p in sorted(tmp.rglob("*.log"))
    ]
    return "\n".join(parts)


@dataclass
class Release:
    """One release's CLI on the test's database."""

    name: str
    command: list[str]  # how to run its `worker`
    python: str
    pythonpath: str
    cwd: Path
    url: str
    tmp: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
        env.update(WORKER_DATABASE_URL=self.url, PYTHONPATH=self.pythonpath, **extra)
        return env

    def cli(self, *args: str, admission_only: bool = False) -> subprocess.CompletedProcess[str]:
        extra = {"WORKER_ADMISSION_ONLY": "1"} if admission_only else {}
        done = subprocess.run(
            [*self.command, *args],
            env=self.env(**extra),
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        with (self.tmp / "cli.log").open("a") as log:
            only = " (admission-only)" if admission_only else ""
            log.write(
                f"$ [{self.name}] worker {' '.join(args)}{only}\nexit {done.returncode}\n"
                f"{done.stdout}{done.stderr}\n"
            )
        return done

    def ok(self, *args: str, admission_only: bool = False) -> subprocess.CompletedProcess[str]:
        done = self.cli(*args, admission_only=admission_only)
        assert done.returncode == 0, (
            f"[{self.name}] worker {' '.join(args)} exited {done.returncode}: "
            f"{done.stderr}\n{tails(self.tmp)}"
        )
        return done

    def submit(
        self, play: str, params: dict[str, Any], *, release: str, admission_only: bool = False
    ) -> str:
        done = self.ok(
            "submit",
            play,
            "--release",
            release,
            "--params",
            json.dumps(params),
            "--json",
            admission_only=admission_only,
        )
        return str(json.loads(done.stdout)["run_id"])


def old_release(build: OldBuild, url: str, tmp: Path) -> Release:
    python = str(build.venv / "bin" / "python")
    return Release(
        "old",
        [python, str(build.venv / "bin" / "worker")],
        python,
        str(build.app),
        build.tree,
        url,
        tmp,
    )


def new_release(build: NewBuild, url: str, tmp: Path) -> Release:
    return Release(
        "new",
        [sys.executable, str(Path(sys.executable).parent / "worker")],
        sys.executable,
        os.pathsep.join([str(build.target), str(build.app)]),
        tmp,
        url,
        tmp,
    )


@dataclass
class Workers:
    """Every worker process a scenario starts: stopped (SIGTERM, then SIGKILL) at its end."""

    tmp: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, release: Release, lane: str, name: str, *extra: str) -> subprocess.Popen[bytes]:
        ready = self.tmp / f"{name}.ready"
        with (self.tmp / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [
                    *release.command,
                    "start",
                    "--release",
                    lane,
                    "--app",
                    APP,
                    "--ready-file",
                    str(ready),
                    "--grace",
                    "2s",
                    *extra,
                ],
                env=release.env(),
                cwd=release.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def start(self, release: Release, lane: str, name: str, *extra: str) -> subprocess.Popen[bytes]:
        """A worker that reported ready."""
        proc = self.spawn(release, lane, name, *extra)
        self.ready(proc, release, lane, name)
        return proc

    def ready(self, proc: subprocess.Popen[bytes], release: Release, lane: str, name: str) -> None:
        """Wait until the spawned worker ``name`` reported ready."""
        ready = self.tmp / f"{name}.ready"
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, (
                f"worker {name} ({release.name}, lane {lane}) exited {proc.returncode} before "
                f"ready\n{tails(self.tmp)}"
            )
            assert time.monotonic() < deadline, f"worker {name} never ready\n{tails(self.tmp)}"
            time.sleep(0.05)

    def terminate(self, proc: subprocess.Popen[bytes], name: str) -> None:
        """SIGTERM: the worker stops (and marks itself stopped) with exit status 0."""
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{name} outlived SIGTERM by 30 s\n{tails(self.tmp)}") from None
        assert code == 0, f"{name} exited {code} on SIGTERM\n{tails(self.tmp)}"

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()


@contextlib.contextmanager
def workers(tmp: Path) -> Iterator[Workers]:
    running = Workers(tmp)
    try:
        yield running
    finally:
        running.close()


def until(probe_fn: Callable[[], T | None], what: str, tmp: Path, timeout: float = 60.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        found = probe_fn()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s\n{tails(tmp)}"
        time.sleep(0.2)


def query(url: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def states(url: str, run_ids: Sequence[str]) -> dict[str, str]:
    rows = query(
        url, "SELECT id::text, state::text FROM wq_runs WHERE id = ANY(%s::uuid[])", (run_ids,)
    )
    return {str(r): str(s) for r, s in rows}


def executions(trace: Path, run_id: str) -> list[dict[str, Any]]:
    path = trace / f"{run_id}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def began(trace: Path, run_id: str, step: str) -> dict[str, Any] | None:
    return next(
        (x for x in executions(trace, run_id) if x["step"] == step and x["event"] == "start"),
        None,
    )


def hold_old_lane(
    old: Release, running: Workers, trace: Path
) -> tuple[subprocess.Popen[bytes], list[str]]:
    """The old release's database, lane and busy worker: it migrates an empty database,
    starts a worker of HELD slots, and admits HELD runs that stop inside their second step
    until the file GATE exists. Returns the worker and the runs, each running on it."""
    old.ok("migrate")
    old.ok("queues", "prepare", OLD)
    old.ok("queues", "set-policy", OLD, *POLICY)
    worker = running.spawn(
        old, OLD, "old-1", "--concurrency", str(HELD), "--claim-ahead-under", "0"
    )
    params = {"count": 3, "gate_at": 1, "gate": GATE, "trace": str(trace), "max_s": 300}
    # Admitted at once (independent admissions, the last one admission-only) while the
    # worker starts: they wait on the lane for it.
    held = together(
        *(
            functools.partial(
                old.submit, "steps", params, release=OLD, admission_only=i == HELD - 1
            )
            for i in range(HELD)
        )
    )
    running.ready(worker, old, OLD, "old-1")
    for run_id in held:
        line = until(
            functools.partial(began, trace, run_id, "s1"), f"held run {run_id} in s1", old.tmp
        )
        assert line["pid"] == worker.pid, line
    return worker, held


def finish_held(old: Release, held: list[str], tmp: Path) -> None:
    """Recover until every held run succeeded (their worker may be dead)."""

    def done() -> bool:
        found = states(old.url, held)
        assert "failed" not in found.values(), f"{found}\n{tails(tmp)}"
        if all(s == "succeeded" for s in found.values()):
            return True
        old.ok("recover", "--once")
        return False

    until(done, "the held old runs succeeded", tmp, timeout=90)


# ---- the scenarios ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)  # a cold build of the previous release's venv may take most of it
async def test_an_old_release_works_inside_the_window_after_an_expand(
    installed_checkout: Future[Path],
    previous_release: OldBuild,
    empty_db: Callable[[], Any],
    tmp_path: Path,
) -> None:
    url = await empty_db()
    trace = tmp_path / "trace"
    trace.mkdir()
    old = old_release(previous_release, url, tmp_path)
    with ThreadPoolExecutor(1) as pool, workers(tmp_path) as running:
        # The new release is made while the old one sets up its lane.
        building = pool.submit(build_new, tmp_path, "expand", installed_checkout)
        first, held = hold_old_lane(old, running, trace)
        new_build = building.result()
        new = new_release(new_build, url, tmp_path)

        # The new release's release phase applies its expand migration.
        migrated = new.ok("migrate", "--json")
        applied = json.loads(migrated.stdout)["applied"]
        assert new_build.probe_name in applied, f"{applied}\n{tails(tmp_path)}"
        assert query(url, "SELECT to_regclass('wq_window_probe') IS NOT NULL") == [(True,)]

        # The old release, inside the window: its whole smoke scenario, on its own lane
        # (the old worker there is busy with the held runs), while the new release's worker
        # starts beside it and runs the new release's own runs.
        out, err = tmp_path / "smoke.stdout", tmp_path / "smoke.stderr"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            smoke = subprocess.Popen(
                [
                    old.python,
                    "-m",
                    "tests.release.smoke",
                    "--release",
                    OLD,
                    "--json",
                    "--workdir",
                    str(tmp_path / "smoke-old"),
                ],
                env={k: v for k, v in old.env().items() if k != "PYTHONPATH"},
                cwd=previous_release.tree,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
            )
        try:
            running.start(new, NEW, "new-1")
            new_runs = together(
                functools.partial(new.submit, "steps", {"count": 3}, release=NEW),
                functools.partial(
                    new.submit, "steps", {"count": 3}, release=NEW, admission_only=True
                ),
                functools.partial(new.submit, "rows", {"count": 20}, release=NEW),
            )
            # Their results are awaited while the smoke runs, and checked below.
            results = pool.submit(
                together,
                *(
                    functools.partial(new.ok, "result", run_id, "--wait", "--timeout", "60s")
                    for run_id in new_runs
                ),
            )
            code = smoke.wait(timeout=180)
        finally:
            if smoke.poll() is None:  # a failure above, or the smoke outlived its timeout
                smoke.kill()
                smoke.wait()
        assert code == 0, (
            f"the smoke scenario of {previous_release.label} failed (exit {code}) on a "
            f"database the new release migrated:\n{tail(err, 4000)}\n{tail(out, 3000)}\n"
            f"{tails(tmp_path)}"
        )

        # The old worker dies mid-run; a fresh old worker starts (inside the window) and,
        # once recovery rescued the lapsed leases, finishes every held run.
        first.kill()
        first.wait()
        (trace / GATE).touch()
        running.start(old, OLD, "old-2")
        finish_held(old, held, tmp_path)
        for run_id in held:
            started = [x["step"] for x in executions(trace, run_id) if x["event"] == "start"]
            assert started.count("s0") == 1 and started.count("s2") == 1, (run_id, started)

        # The new release's own runs.
        results.result()

    by_state = dict(query(url, "SELECT state::text, count(*) FROM wq_runs GROUP BY 1"))
    assert set(by_state) <= {"succeeded", "cancelled"}, f"{by_state}\n{tails(tmp_path)}"
    assert by_state.get("cancelled", 0) <= 1, by_state  # only the smoke's cancelled run


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_contract_waits_for_the_old_lane_then_closes_the_window(
    installed_checkout: Future[Path],
    previous_release: OldBuild,
    empty_db: Callable[[], Any],
    tmp_path: Path,
) -> None:
    url = await empty_db()
    trace = tmp_path / "trace"
    trace.mkdir()
    old = old_release(previous_release, url, tmp_path)
    with ThreadPoolExecutor(1) as pool, workers(tmp_path) as running:
        # The new release is made while the old one sets up its lane.
        building = pool.submit(build_new, tmp_path, "contract", installed_checkout)
        first, held = hold_old_lane(old, running, trace)
        new_build = building.result()
        probe_name = new_build.probe_name
        new = new_release(new_build, url, tmp_path)

        # The old lane has unfinished runs and a live worker: the contract waits. The
        # ordinary migrate applies the new release's other migrations and defers it; then
        # forcing it and checking (neither of which applies anything) are run at once.
        deferred = new.cli("migrate")
        assert deferred.returncode == 0, f"{deferred.stderr}\n{tails(tmp_path)}"
        blocked = [
            line for line in deferred.stderr.splitlines() if "CONTRACT_BLOCKED_BY_LANES" in line
        ]
        assert blocked and OLD_LANE in " ".join(blocked), f"{deferred.stderr}\n{tails(tmp_path)}"
        forced, check = together(
            functools.partial(new.cli, "migrate", "--contract"),
            functools.partial(new.cli, "migrate", "--check", "--json"),
        )
        assert forced.returncode == 1, f"{forced.stderr}\n{tails(tmp_path)}"
        assert "error[CONTRACT_BLOCKED_BY_LANES]" in forced.stderr, forced.stderr
        assert check.returncode == 1, f"{check.stdout}{check.stderr}"
        pending = {p["name"]: p for p in json.loads(check.stdout)["steps"]}
        assert pending.get(probe_name, {}).get("kind") == "contract", pending
        assert OLD_LANE in pending[probe_name].get("blocked_by", []), pending
        assert query(url, "SELECT count(*) FROM wq_migrations WHERE name = %s", (probe_name,)) == [
            (0,)
        ]

        # The new release serves its own lane meanwhile.
        running.start(new, NEW, "new-1")
        before = new.submit("steps", {"count": 3}, release=NEW)
        new.ok("result", before, "--wait", "--timeout", "60s")

        # The old lane empties, its worker stops, the lane is reclaimed: the contract goes.
        (trace / GATE).touch()
        finish_held(old, held, tmp_path)
        running.terminate(first, "old-1")
        new.ok("queues", "reclaim", OLD)
        applied = json.loads(new.ok("migrate", "--json").stdout)["applied"]
        assert probe_name in applied, f"{applied}\n{tails(tmp_path)}"

        # The window is closed to the old release: its worker and its lane-preparing submit
        # refuse, naming the contract migration. The new release goes on. (The old worker
        # is awaited last: it starts, refuses and exits while the commands run.)
        refused = running.spawn(old, OLD, "old-2")
        submitted = old.cli("submit", "steps", "--release", "old2", "--params", "{}")
        assert submitted.returncode == 1, f"{submitted.stdout}{submitted.stderr}"
        assert "error[SCHEMA_WINDOW_CLOSED]" in submitted.stderr, submitted.stderr
        assert probe_name in submitted.stderr, submitted.stderr
        after = new.submit("steps", {"count": 3}, release=NEW)
        new.ok("result", after, "--wait", "--timeout", "60s")
        try:
            code = refused.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        log = tail(tmp_path / "old-2.log", 4000)
        assert code == 1, f"the old worker after the contract: exit {code}\n{tails(tmp_path)}"
        assert "error[SCHEMA_WINDOW_CLOSED]" in log and probe_name in log, log

    by_state = dict(query(url, "SELECT state::text, count(*) FROM wq_runs GROUP BY 1"))
    assert set(by_state) == {"succeeded"}, f"{by_state}\n{tails(tmp_path)}"
