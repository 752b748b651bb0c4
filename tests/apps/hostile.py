"""A hostile sandboxed play: it tries what an attacker's play would, and reports what it got
(``worker start --app tests.apps.hostile:registry``; tests/e2e/test_sandbox_escape.py).

Each probe records what it saw, or the error that stopped it; the test asserts that none of
it holds a credential, and that every way out was refused.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx
import jwt

from queues.errors import WorkerError
from worker.context import RunContext
from worker.plays import Registry

registry = Registry()


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return "read: " + f.read(1 << 20).decode(errors="replace")
    except OSError as exc:
        return f"error: {type(exc).__name__}: {exc.strerror}"


def _listdir(path: str) -> list[str] | str:
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        return f"error: {type(exc).__name__}: {exc.strerror}"


def _walk(top: str) -> dict[str, str]:
    """Every file under ``top`` it could read (its content), or why not."""
    found: dict[str, str] = {}
    if not os.path.exists(top):
        return {top: "error: it does not exist here"}
    for here, _, files in os.walk(top, onerror=lambda e: found.setdefault(top, repr(e))):
        for name in files:
            path = os.path.join(here, name)
            found[path] = _read(path)[:2000]
    return found


def _connect(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=2):
            return "connected"
    except OSError as exc:
        return f"error: {type(exc).__name__}: {exc.strerror or exc}"


def _forge(secret: bytes, victim: dict[str, Any]) -> str:
    now = int(time.time())
    claims = {
        "iss": "wq",
        "sub": victim["run_id"],
        "org": victim["org"],
        "play": victim["play"],
        "run": victim["run_id"],
        "release": victim["release"],
        "attempt": 1,
        "owner": "forger",
        "caps": ["run.read", "sheet.write", "receipt.write", "run.spawn", "limit.acquire"],
        "iat": now,
        "exp": now + 600,
        "jti": uuid.uuid4().hex,
    }
    return jwt.encode(claims, secret.ljust(32, b"x"), algorithm="HS256")


def _post(token: str, body: dict[str, Any]) -> int:
    """POST a body straight to the gateway's socket with ``token``: the status code."""
    transport = httpx.HTTPTransport(uds=os.environ.get("WORKER_GATEWAY_SOCKET", "/nonexistent"))
    try:
        with httpx.Client(transport=transport, timeout=10) as client:
            response = client.post(
                "http://gateway/runtime",
                json=body,
                headers={"Authorization": f"Bearer {token}"},
            )
            return response.status_code
    except httpx.HTTPError as exc:
        return -1 if "No such file" in str(exc) else -2


async def _refused(call: Any) -> str:
    try:
        await call()
    except WorkerError as exc:
        return exc.code
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "allowed"


@registry.play(
    "hostile",
    sandboxed=True,
    may_spawn=["allowed-child"],
    limits=["shared"],
    resources={"memory": "1G", "processes": 512},
)
async def hostile(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {"uid": os.getuid(), "euid": os.geteuid(), "pid": os.getpid()}
    worker_pid = int(params["worker_pid"])
    home = str(params["home"])

    # The worker's process and its environment; every process it can see.
    seen["worker_environ"] = _read(f"/proc/{worker_pid}/environ")
    seen["worker_cmdline"] = _read(f"/proc/{worker_pid}/cmdline")
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    seen["proc_pids"] = pids
    seen["environs"] = {str(pid): _read(f"/proc/{pid}/environ") for pid in pids}
    seen["own_environment"] = dict(os.environ)

    # The worker's home: its secret, and any file in it.
    seen["home_listing"] = _listdir(home)
    seen["home_secret"] = _read(os.path.join(home, "secret"))
    seen["home_files"] = _walk(home)

    # The network: the embedded Postgres port and anything on 127.0.0.1.
    ports = sorted({int(params["pg_port"]), 5432, 80, 443, 8085, 22})
    seen["tcp"] = {str(port): _connect("127.0.0.1", port) for port in ports}

    # Forge a token for another org's run with whatever could be a secret.
    candidates = [b"guess" * 8]
    for text in (seen["home_secret"], *seen["environs"].values()):
        if text.startswith("read: "):
            for part in text[6:].replace("\0", "\n").splitlines():
                value = part.partition("=")[2] or part
                if len(value) >= 16:
                    candidates.append(value.encode())
    victim = dict(params["victim"])
    page = {"action": "runtime_input_page", "input": {"page": 0, "runId": victim["run_id"]}}
    seen["forged"] = sorted({_post(_forge(c, victim), page) for c in candidates})

    # Spawn a play it did not declare, take a limit it did not declare; the declared ones.
    seen["spawn_undeclared"] = await _refused(lambda: ctx.spawn("forbidden-child", {"x": 1}))

    async def take(key: str) -> None:
        async with ctx.limit(key):
            pass

    seen["limit_undeclared"] = await _refused(lambda: take("other"))
    seen["spawn_declared"] = await _refused(lambda: ctx.spawn("allowed-child", {}))
    seen["limit_declared"] = await _refused(lambda: take("shared"))

    # Its resource limits, and an attempt to raise them.
    seen["rlimits"] = {
        "memory": list(resource.getrlimit(resource.RLIMIT_AS)),
        "processes": list(resource.getrlimit(resource.RLIMIT_NPROC)),
        "cpu_s": list(resource.getrlimit(resource.RLIMIT_CPU)),
    }
    try:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
        seen["rlimit_raised"] = "raised"
    except (ValueError, OSError) as exc:
        seen["rlimit_raised"] = f"error: {type(exc).__name__}"

    # A process in a session of its own, meant to outlive the run.
    marker = str(params["marker"])
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", marker],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.2)
    seen["orphan_alive_at_return"] = orphan.poll() is None
    return seen


@registry.play("boxed-step", sandboxed=True)
async def boxed_step(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    """A plain sandboxed play: one step through the gateway (its tokens verified there)."""
    return {"step": await ctx.step("one", lambda: 1)}


@registry.play("allowed-child")
async def allowed_child(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True}


@registry.play("forbidden-child")
async def forbidden_child(ctx: RunContext, params: dict[str, Any]) -> dict[str, Any]:
    return {"ran": True}  # a trusted, in-process play: the sandbox must not reach it
