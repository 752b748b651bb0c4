"""The ``worker`` console script end to end: error shapes, help, and the embedded default.

Every test runs the installed console script in a subprocess, as an operator would.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import psycopg
import pytest

from queues import migrations
from tests.scratch import scratch
from tests.workers import together
from worker import config, embedded
from worker.cli import cli

cli.loaded()  # the commands load lazily; these tests walk all of them

WORKER = Path(sys.executable).parent / "worker"
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/x"
URL_VARIABLES = ("DATABASE_URL", "WORKER_DATABASE_URL", "WORKER_HOME")
# The embedded default holds outside production only: without these, the tests run the same
# on a runner that sets a platform variable (a CI job in a Kubernetes pod, say).
PRODUCTION_VARIABLES = ("WORKER_ENV", *(name for name, _ in config.PLATFORM_VARIABLES))


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in URL_VARIABLES and k not in PRODUCTION_VARIABLES
    }
    env.update(extra)
    return env


def worker(
    *args: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(WORKER), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def workers_at_once(
    *calls: tuple[str, ...], env: dict[str, str]
) -> list[subprocess.CompletedProcess[str]]:
    """Run commands that only read (each its own process, as ``worker`` would) at the same
    time; their results in the order given."""
    return together(*(functools.partial(worker, *args, env=env) for args in calls))


def assert_clean_error(res: subprocess.CompletedProcess[str], code: str, exit_code: int) -> None:
    detail = f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.returncode == exit_code, detail
    assert f"error[{code}]" in res.stderr, detail
    assert "Traceback" not in res.stderr + res.stdout, detail


# ---- error shapes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("migrate",),
        ("migrate", "--check"),
        ("queues", "list"),
        ("queues", "prepare", "blue"),
    ],
)
def test_unreachable_database(args: tuple[str, ...]) -> None:
    res = worker(*args, env=clean_env(WORKER_DATABASE_URL=UNREACHABLE))
    assert_clean_error(res, "DATABASE_UNREACHABLE", 6)
    assert "127.0.0.1:1" in res.stderr


def test_unreachable_database_via_flag_and_database_url() -> None:
    res = worker("--database-url", UNREACHABLE, "migrate", env=clean_env())
    assert_clean_error(res, "DATABASE_UNREACHABLE", 6)
    res = worker("migrate", env=clean_env(DATABASE_URL=UNREACHABLE))
    assert_clean_error(res, "DATABASE_UNREACHABLE", 6)


def test_unreachable_error_does_not_print_the_password() -> None:
    url = "postgresql://postgres:s3cret@127.0.0.1:1/x"
    res = worker("migrate", env=clean_env(WORKER_DATABASE_URL=url))
    assert_clean_error(res, "DATABASE_UNREACHABLE", 6)
    assert "s3cret" not in res.stderr


@pytest.mark.parametrize("url", ["host=localhost port", "postgresql://[::1/x", "mysql://u@h/db"])
def test_malformed_url(url: str) -> None:
    res = worker("migrate", env=clean_env(DATABASE_URL=url))
    assert_clean_error(res, "DATABASE_URL_INVALID", 2)
    assert "DATABASE_URL" in res.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--log-level", "LOUD", "migrate"),
        ("queues", "prepare", "bad;name"),
        ("migrate", "--no-such-flag"),
        ("no-such-command",),
        ("result", "not-a-uuid"),
        ("runs", "list", "--limit", "0"),
    ],
)
def test_bad_input_exits_2(args: tuple[str, ...]) -> None:
    # A bad value is refused before anything connects: the unreachable URL is never used.
    res = worker(*args, env=clean_env(WORKER_DATABASE_URL=UNREACHABLE))
    detail = f"exit {res.returncode}\nstderr:\n{res.stderr}"
    assert res.returncode == 2, detail
    assert res.stderr.startswith("error["), detail
    assert "DATABASE_UNREACHABLE" not in res.stderr, detail
    assert "Traceback" not in res.stderr, detail


def test_bad_release_names_the_field() -> None:
    res = worker("queues", "prepare", "bad;name", env=clean_env(WORKER_DATABASE_URL=UNREACHABLE))
    assert_clean_error(res, "FIELD_INVALID", 2)
    assert "RELEASE" in res.stderr


# ---- help ---------------------------------------------------------------------------------


def _command_lines(help_text: str) -> list[str]:
    lines = help_text.splitlines()
    start = lines.index("Commands:") + 1
    section: list[str] = []
    for line in lines[start:]:
        if not line.strip():
            break
        section.append(line)
    return section


def _groups() -> list[tuple[tuple[str, ...], click.Group]]:
    found: list[tuple[tuple[str, ...], click.Group]] = [((), cli)]
    for name, command in cli.commands.items():
        if isinstance(command, click.Group):
            found.append(((name,), command))
    return found


@pytest.mark.parametrize(
    ("path", "group"), _groups(), ids=[" ".join(("worker", *p)) for p, _ in _groups()]
)
def test_help_lists_every_command_on_one_line(path: tuple[str, ...], group: click.Group) -> None:
    res = worker(*path, "--help", env=clean_env(WORKER_DATABASE_URL=UNREACHABLE))
    assert res.returncode == 0, res.stderr
    lines = _command_lines(res.stdout)
    names = []
    for line in lines:
        match = re.match(r"^  (\S+)\s{2,}(\S.*)$", line)
        assert match, f"not a one-line command entry (wrapped help?): {line!r}"
        names.append(match.group(1))
    assert sorted(names) == sorted(group.commands), res.stdout
    for name, command in group.commands.items():
        assert command.help, f"`worker {' '.join((*path, name))}` has no help text"


# ---- the embedded default ("done means") --------------------------------------------------


@pytest.fixture
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="worker-cli-", dir=scratch()))
    path.chmod(0o755)
    try:
        yield path
    finally:
        with contextlib.suppress(Exception):
            embedded.stop(path, mode="immediate")
        shutil.rmtree(path, ignore_errors=True)


STATUS = ("db", "status", "--json")


def _status(env: dict[str, str]) -> dict[str, Any]:
    return _parsed_status(worker(*STATUS, env=env))


def _parsed_status(res: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert res.returncode == 0, res.stderr
    data: dict[str, Any] = json.loads(res.stdout)
    return data


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
def test_embedded_default_migrate_reuse_and_crash_recovery(home: Path) -> None:
    env = clean_env(WORKER_HOME=str(home))
    contract = migrations.code_contract()
    n = len(migrations.code_migrations()) + 1  # procrastinate's schema.sql, then ours

    assert _status(env)["running"] is False

    first = worker("migrate", env=env)
    assert first.returncode == 0, first.stderr
    assert f"applied {n} migration(s)" in first.stdout
    check, shown = workers_at_once(("migrate", "--check"), STATUS, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"schema is current: version {contract.version}" in check.stdout
    status = _parsed_status(shown)
    assert status["running"] is True
    assert status["datadir"] == str(home / "pgdata")
    pid = status["pid"]
    assert isinstance(pid, int) and _alive(pid)

    # Run again: the same server is reused and nothing is applied twice.
    again = worker("migrate", env=env)
    assert again.returncode == 0, again.stderr
    assert "applied 0 migration(s)" in again.stdout
    check, shown = workers_at_once(("migrate", "--check"), STATUS, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert _parsed_status(shown)["pid"] == pid

    # kill -9 the postmaster: the next command restarts it (crash recovery) and the data stays.
    pidfd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        # Wait for the exit itself (the pidfd turns readable), not for a guessed delay.
        assert select.select([pidfd], [], [], 30)[0], f"postmaster {pid} survived SIGKILL"
    finally:
        os.close(pidfd)
    assert _status(env)["running"] is False
    recovered = worker("migrate", "--check", env=env)
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    assert f"schema is current: version {contract.version}" in recovered.stdout
    status = _status(env)
    assert status["running"] is True and status["pid"] != pid

    stop = worker("db", "stop", env=env)
    assert stop.returncode == 0, stop.stderr
    assert stop.stdout.strip() == "stopped"
    # Both only look now: nothing runs.
    shown, stop_again = workers_at_once(STATUS, ("db", "stop"), env=env)
    assert _parsed_status(shown)["running"] is False
    assert stop_again.stdout.strip() == "not running"


@pytest.mark.parametrize(
    "production", [{"WORKER_ENV": "production"}, {"DYNO": "web.1"}], ids=["WORKER_ENV", "DYNO"]
)
def test_production_without_a_database_url_starts_no_server(
    home: Path, production: dict[str, str]
) -> None:
    res = worker("submit", "noop", env=clean_env(WORKER_HOME=str(home), **production))
    assert_clean_error(res, "DATABASE_URL_MISSING", 2)
    assert "Fix: set WORKER_DATABASE_URL or DATABASE_URL" in res.stderr
    assert "WORKER_ENV=development" in res.stderr
    assert list(home.iterdir()) == []  # no data directory, no server
    assert _status(clean_env(WORKER_HOME=str(home)))["running"] is False


@pytest.mark.slow
def test_db_url_gives_each_role_its_own_login_and_status_hides_the_secret(home: Path) -> None:
    env = clean_env(WORKER_HOME=str(home))
    res = worker("db", "url", "--role", "owner", env=env)
    assert res.returncode == 0, res.stderr
    owner = res.stdout.strip()
    secret = (home / "secret").read_text().strip()
    assert owner.startswith(f"postgresql://postgres:{secret}@127.0.0.1:"), owner
    assert secret not in res.stderr  # the log lines of a first start
    migrated = worker("migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr

    roles = ("worker", "admission", "reader")
    *got, default = workers_at_once(
        *(("db", "url", "--role", role) for role in roles), ("db", "url"), env=env
    )
    urls = {}
    for role, res in zip(roles, got, strict=True):
        assert res.returncode == 0, res.stderr
        urls[role] = res.stdout.strip()
        assert urls[role].startswith(f"postgresql://wq_{role}:"), urls[role]
        assert secret not in urls[role]  # a password of its own (derived), not the secret
    assert default.stdout.strip() == urls["worker"]  # the default
    with psycopg.connect(urls["worker"]) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("wq_worker",)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE TABLE mine (x int)")
    with (
        psycopg.connect(urls["admission"]) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute("SELECT params FROM wq_runs")
    with psycopg.connect(urls["reader"]) as conn:
        assert conn.execute("SELECT count(*) FROM wq_runs").fetchone() == (0,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM wq_runs")

    *listed, shown = workers_at_once(("db", "status"), STATUS, STATUS, env=env)
    for res in listed:
        assert res.returncode == 0, res.stderr
        assert secret not in res.stdout + res.stderr
    status = _parsed_status(shown)
    assert status["url"] == owner.replace(f":{secret}@", "@")
    assert status["secret_file"] == str(home / "secret")

    # The README's recipe. The commands after it cannot fall back to the embedded server
    # (their WORKER_HOME cannot exist), so they succeed only through the exported URLs:
    # migrate as the owner, everything else as the worker role.
    recipe = (
        f'export WORKER_MIGRATE_DATABASE_URL=$("{WORKER}" db url --role owner)\n'
        f'export WORKER_DATABASE_URL=$("{WORKER}" db url)\n'
        f'WORKER_HOME="{home}/secret/none" "{WORKER}" migrate\n'
        f'WORKER_HOME="{home}/secret/none" "{WORKER}" queues prepare r1\n'
    )
    ran = subprocess.run(
        ["sh", "-ec", recipe], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert ran.returncode == 0, ran.stderr
    assert "applied" in ran.stdout and "lane r-r1 prepared" in ran.stdout
    assert secret not in ran.stdout + ran.stderr
