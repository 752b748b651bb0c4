"""Untrusted plays are contained for real: a `worker start` process started like production
(WORKER_DATABASE_URL and WORKER_TOKEN_SECRET in its environment, WORKER_HOME the embedded
server's home, its gateway in-process) runs a hostile sandboxed play
(tests/apps/hostile.py) in bubblewrap, and the play gets nothing: not the worker's
environment, not its home, no network, no secret to forge a token with, no play or limit it
did not declare, no process that outlives its run. The worker's own /proc/PID/environ holds
no password and no secret (the re-exec hand-off), and where there is no sandbox the run
fails with SANDBOX_UNAVAILABLE instead of running unsandboxed.

Real processes and real bubblewrap: a machine without it fails these tests with the reason
(scripts/install-test-deps installs it); they never skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from queues import admission, lanes, limits, runs
from tests.e2e.test_cli_scheduler import REPO, WORKER, cli_env, eventually
from tests.workers import fetch

APP = "tests.apps.hostile:registry"
RELEASE = "sbx-escape"


def require_bubblewrap() -> None:
    """Fail (never skip) where the sandbox cannot run: the reason, and the fix."""
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap (bwrap) is not installed: run scripts/install-test-deps")


@contextlib.asynccontextmanager
async def worker(
    db_url: str, tmp_path: Path, name: str, *args: str, **env: str | None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A `worker start ARGS` process of the hostile app that reported ready (``env``: more
    variables; None removes one); killed on the way out."""
    ready = tmp_path / f"{name}.ready"
    environment = cli_env(db_url)
    for key, value in env.items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            str(WORKER),
            "--json-logs",
            "start",
            "--release",
            RELEASE,
            "--app",
            APP,
            "--ready-file",
            str(ready),
            "--grace",
            "1",
            *args,
            cwd=REPO,
            env=environment,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:

        async def is_ready() -> bool:
            assert proc.returncode is None, log.read_text()
            with contextlib.suppress(OSError, ValueError):
                return bool(json.loads(ready.read_text())["worker_id"])
            return False

        await eventually(is_ready, f"worker {name}", timeout=60)
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def ended(db_url: str, run_id: uuid.UUID) -> runs.Run:
    async def terminal() -> runs.Run | None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            run = await runs.get(conn, run_id)
        return run if run.terminal else None

    return await eventually(terminal, f"run {run_id} to end", timeout=90)


async def submit(db_url: str, play: str, params: dict[str, Any], **kw: Any) -> uuid.UUID:
    release = kw.pop("release", RELEASE)
    inputs = kw.pop("inputs", None)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await lanes.prepare(conn, release)
        admitted = await admission.submit(
            conn,
            admission.Submission(play=play, params=params, release=release, **kw),
            inputs=inputs,
        )
    return admitted.run_id


async def server_home(db_url: str) -> Path:
    """The embedded test server's home (its data directory's parent): holds `secret`."""
    [(data,)] = await fetch(db_url, "SHOW data_directory")
    home = Path(data).parent
    assert (home / "secret").is_file(), home
    return home


def processes_with(marker: str) -> list[int]:
    """The pids of this machine's processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
    return found


async def test_a_hostile_sandboxed_play_gets_nothing_out(db_url: str, tmp_path: Path) -> None:
    require_bubblewrap()
    home = await server_home(db_url)
    embedded_secret = (home / "secret").read_text().strip()
    password = str(conninfo_to_dict(db_url)["password"])
    port = int(conninfo_to_dict(db_url)["port"])
    token_secret = secrets.token_urlsafe(48)
    assert password and embedded_secret
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await limits.set_limit(conn, "shared", rate="100/s")
        await limits.set_limit(conn, "other", concurrency=1)
    victim = await submit(
        db_url, "payroll", {}, release="victim", org="another-org", inputs=[("k", {"pan": 1})]
    )
    marker = f"wq-orphan-{uuid.uuid4().hex}"
    async with worker(
        db_url, tmp_path, "hostile", WORKER_TOKEN_SECRET=token_secret, WORKER_HOME=str(home)
    ) as proc:
        params = {
            "worker_pid": proc.pid,
            "home": str(home),
            "pg_port": port,
            "victim": {
                "run_id": str(victim),
                "org": "another-org",
                "play": "payroll",
                "release": "victim",
            },
            "marker": marker,
        }
        run = await ended(db_url, await submit(db_url, "hostile", params))
        # The run has ended: nothing it started is left, on the whole machine.
        assert processes_with(marker) == []
    assert run.state == "succeeded", run.error
    seen = run.result
    text = json.dumps(seen)
    # Not root, and in a PID namespace of its own: the worker is not there to read.
    assert seen["uid"] == seen["euid"] == 65534, seen
    assert seen["worker_environ"].startswith("error"), seen["worker_environ"]
    assert seen["worker_cmdline"].startswith("error"), seen["worker_cmdline"]
    assert proc.pid not in seen["proc_pids"] and max(seen["proc_pids"]) < 10, seen["proc_pids"]
    # No credential anywhere in what it could read.
    for credential in (password, token_secret, embedded_secret):
        assert credential not in text
    for name in ("DATABASE_URL", "WORKER_TOKEN_SECRET", "WORKER_RUN_TOKEN", "WORKER_HOME"):
        assert name not in text, name
    # Nothing of the worker's home.
    assert isinstance(seen["home_listing"], str) and seen["home_listing"].startswith("error")
    assert seen["home_secret"].startswith("error"), seen["home_secret"]
    assert all(v.startswith("error") for v in seen["home_files"].values()), seen["home_files"]
    # No network: not the embedded Postgres, not anything on 127.0.0.1.
    assert str(port) in seen["tcp"]
    assert all(v.startswith("error") for v in seen["tcp"].values()), seen["tcp"]
    # No secret to sign with: every forged token is refused (401).
    assert seen["forged"] == [401], seen["forged"]
    # Least authority: only what it declared.
    assert seen["spawn_undeclared"] == "RUNTIME_CAPABILITY_SCOPE", seen["spawn_undeclared"]
    assert seen["limit_undeclared"] == "RUNTIME_CAPABILITY_SCOPE", seen["limit_undeclared"]
    assert seen["spawn_declared"] == "allowed" and seen["limit_declared"] == "allowed", seen
    assert await fetch(db_url, "SELECT count(*) FROM wq_runs WHERE play = 'forbidden-child'") == [
        (0,)
    ]
    # Its resource limits: the play's own (1G, 512 processes), the default CPU time; fixed.
    assert seen["rlimits"] == {
        "memory": [1 << 30, 1 << 30],
        "processes": [512, 512],
        "cpu_s": [3600, 3600],
    }, seen["rlimits"]
    assert seen["rlimit_raised"].startswith("error"), seen["rlimit_raised"]
    # Its session-leading child was alive when it returned, and is gone now.
    assert seen["orphan_alive_at_return"] is True


async def test_a_worker_process_environment_holds_no_password_and_no_secret(
    db_url: str, tmp_path: Path
) -> None:
    require_bubblewrap()
    password = str(conninfo_to_dict(db_url)["password"]).encode()
    token_secret = secrets.token_urlsafe(48)
    assert password
    async with worker(db_url, tmp_path, "environ", WORKER_TOKEN_SECRET=token_secret) as proc:
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        # It is the same process (re-executed in place), and it works: a sandboxed run's
        # tokens signed and verified with the secret it no longer has in its environment.
        run = await ended(db_url, await submit(db_url, "boxed-step", {}))
    assert run.state == "succeeded" and run.result == {"step": 1}, run.error
    variables = dict(item.split(b"=", 1) for item in environ.split(b"\0") if b"=" in item)
    assert b"WORKER_DATABASE_URL" not in variables and b"WORKER_TOKEN_SECRET" not in variables
    assert password not in environ and token_secret.encode() not in environ
    assert b"PYTHONPATH" in variables  # the rest of its environment is kept

    # The container convention: each secret read from the file NAME_FILE names.
    url_file, secret_file = tmp_path / "database-url", tmp_path / "token-secret"
    url_file.write_text(db_url + "\n")
    secret_file.write_text(token_secret + "\n")
    url_file.chmod(0o600)
    secret_file.chmod(0o600)
    async with worker(
        db_url,
        tmp_path,
        "files",
        WORKER_DATABASE_URL=None,
        WORKER_DATABASE_URL_FILE=str(url_file),
        WORKER_TOKEN_SECRET_FILE=str(secret_file),
    ) as proc:
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        run = await ended(db_url, await submit(db_url, "boxed-step", {}))
    assert password not in environ and token_secret.encode() not in environ
    assert run.state == "succeeded" and run.result == {"step": 1}, run.error


async def test_without_a_sandbox_a_sandboxed_play_fails_and_never_runs(
    db_url: str, tmp_path: Path
) -> None:
    missing = str(tmp_path / "no-such-bwrap")
    async with worker(
        db_url,
        tmp_path,
        "nosandbox",
        WORKER_TOKEN_SECRET=secrets.token_urlsafe(48),
        WORKER_SANDBOX_BWRAP=missing,
    ):
        run = await ended(db_url, await submit(db_url, "boxed-step", {}))
    assert run.state == "failed", run
    assert run.error["code"] == "SANDBOX_UNAVAILABLE", run.error
    assert missing in run.error["message"] and "bubblewrap" in run.error["message"]
    assert run.attempt == 1  # not retried: it would fail the same way on this worker
    lines = [
        json.loads(line)
        for line in (tmp_path / "nosandbox.log").read_text().splitlines()
        if line.startswith("{")
    ]
    # As it started, the worker said it had no sandbox, and why.
    mechanism = next(line for line in lines if line.get("event") == "sandbox_mechanism")
    assert mechanism["mechanism"] == "none" and missing in mechanism["reason"], mechanism


async def test_sandboxes_reach_a_separate_gateway_over_its_unix_socket(
    db_url: str, tmp_path: Path
) -> None:
    require_bubblewrap()
    token_secret = secrets.token_urlsafe(48)
    socket = tmp_path / "gateway.sock"
    environment = cli_env(db_url, WORKER_TOKEN_SECRET=token_secret)
    gateway = await asyncio.create_subprocess_exec(
        str(WORKER),
        "gateway",
        "--socket",
        str(socket),
        cwd=REPO,
        env=environment,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    try:

        async def serving() -> bool:
            assert gateway.returncode is None, "the gateway exited"
            return socket.exists()

        await eventually(serving, "the gateway's socket", timeout=60)
        # Its environment holds neither the URL's password nor the secret either.
        environ = Path(f"/proc/{gateway.pid}/environ").read_bytes()
        assert str(conninfo_to_dict(db_url)["password"]).encode() not in environ
        assert token_secret.encode() not in environ
        async with worker(
            db_url,
            tmp_path,
            "separate",
            "--gateway-url",
            f"unix://{socket}",
            WORKER_TOKEN_SECRET=token_secret,
        ):
            run = await ended(db_url, await submit(db_url, "boxed-step", {}))
        assert run.state == "succeeded" and run.result == {"step": 1}, run.error
        # A gateway over TCP is refused as the worker starts: a sandbox has no network.
        refused = await asyncio.create_subprocess_exec(
            str(WORKER),
            "start",
            "--release",
            RELEASE,
            "--app",
            APP,
            "--gateway-url",
            "http://127.0.0.1:8085",
            cwd=REPO,
            env=environment,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(refused.communicate(), 60)
        assert refused.returncode != 0 and b"not a Unix socket" in err, err
    finally:
        gateway.terminate()
        await gateway.wait()
