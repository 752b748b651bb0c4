"""`worker dashboard` keeps no secret in its environment: started with its login secret
and a database URL (with a password) in the environment, it re-executes itself without
them, its /proc/PID/environ holds neither, and the secret it handed itself still logs in.
The same with the secret in a file (WORKER_DASHBOARD_SECRET_FILE)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.dashboards import SECRET, logged_in

WORKER = Path(sys.executable).parent / "worker"
ROOT = Path(__file__).resolve().parents[2]


def start(db_url: str, log: Path, **env: str) -> tuple[subprocess.Popen[bytes], str]:
    """A `worker dashboard` on a free port; its pid and URL once it serves."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("WORKER_") and k not in {"DATABASE_URL", "VERCEL"}
    }
    out = log.open("wb")
    proc = subprocess.Popen(
        [str(WORKER), "dashboard", "--port", "0"],
        env={**base, "PYTHONPATH": str(ROOT), "WORKER_DATABASE_URL": db_url, **env},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=out,
    )
    out.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if "dashboard serving on " in line:
                return proc, line.split("dashboard serving on ", 1)[1].split(";")[0]
        assert proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the dashboard never served: {log.read_text()[-2000:]}")


@pytest.mark.parametrize("given", ["variable", "file"])
async def test_the_dashboard_holds_no_secret_in_its_environment(
    db_url: str, tmp_path: Path, given: str
) -> None:
    password = str(conninfo_to_dict(db_url)["password"]).encode()
    assert password
    env = {"WORKER_DASHBOARD_SECRET": SECRET}
    if given == "file":
        secret_file = tmp_path / "dashboard-secret"
        secret_file.write_text(SECRET + "\n")
        secret_file.chmod(0o600)
        env = {"WORKER_DASHBOARD_SECRET_FILE": str(secret_file)}
    proc, url = start(db_url, tmp_path / "dashboard.log", **env)
    try:
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        async with logged_in(url) as client:  # the secret it no longer has in its environ
            assert (await client.get("/runs")).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    variables = dict(item.split(b"=", 1) for item in environ.split(b"\0") if b"=" in item)
    assert b"WORKER_DASHBOARD_SECRET" not in variables
    assert b"WORKER_DATABASE_URL" not in variables
    assert SECRET.encode() not in environ and password not in environ
    assert b"PYTHONPATH" in variables  # the rest of its environment is kept
