"""The embedded server run by root, attacked by the ``postgres`` OS user that runs it: root
never writes through a link that user planted, its lock is root's alone, and a home that
others may write is refused. And any user: an embedded role whose password a session of
it changed is named at once, with the fix.

The root tests run as root in CI; anywhere else they fail and say why (a skip would hide
that the attack was never tried).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from queues.errors import DatabaseUnreachable, EmbeddedPostgresError
from worker import db, embedded

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(sys.executable).parent / "worker"
BOUND_S = 60


def _require_root() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.fail(
            "this test attacks root's handling of the embedded server as the postgres user: "
            "run it as root (CI does)"
        )
    return pwd.getpwnam(os.environ.get("WORKER_PG_USER", "postgres"))


def _new_home() -> Path:
    path = Path(tempfile.mkdtemp(prefix="worker-root-", dir="/tmp"))
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    path = _new_home()
    try:
        embedded.ensure_running(path)
        yield path
    finally:
        with contextlib.suppress(Exception):
            embedded.stop(path, mode="immediate")
        shutil.rmtree(path, ignore_errors=True)


def _as(pw: pwd.struct_passwd, *cmd: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        list(cmd),
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
        user=pw.pw_uid,
        group=pw.pw_gid,
        extra_groups=[],
        cwd="/",
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _run_as(pw: pwd.struct_passwd, *cmd: str) -> tuple[int, str]:
    proc = _as(pw, *cmd)
    out, _ = proc.communicate(timeout=BOUND_S)
    return proc.returncode, out


def test_root_never_writes_through_a_link_the_postgres_user_planted(home: Path) -> None:
    pw = _require_root()
    datadir = home / "pgdata"
    vault = Path(tempfile.mkdtemp(prefix="worker-vault-"))  # root's, 0700
    try:
        precious = vault / "shadow"
        precious.write_text("root's own\n")
        precious.chmod(0o600)
        # The postgres user edits pg_hba.conf (so root rewrites it at the next start) and
        # plants a link where root made its temporary copy: .pg_hba.conf.<root's pid>.
        hba = datadir / "pg_hba.conf"
        planted = datadir / f".pg_hba.conf.{os.getpid()}"
        edit = f"echo 'host all all 0.0.0.0/0 trust' >> {hba} && ln -s {precious} {planted}"
        code, out = _run_as(pw, "sh", "-c", edit)
        assert code == 0, out
        assert planted.is_symlink() and not embedded._hba_secure(datadir)

        failed: Exception | None = None
        try:
            embedded.ensure_running(home)  # sees pg_hba.conf is not ours, and rewrites it
        except Exception as exc:  # checked after what matters: was the link followed?
            failed = exc

        assert precious.read_text() == "root's own\n", "root wrote through the planted link"
        info = precious.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o600), "and gave it away"
        assert failed is None, failed
        assert not hba.is_symlink() and hba.read_text() == embedded._HBA
        written = hba.stat()
        assert (written.st_uid, stat.S_IMODE(written.st_mode)) == (pw.pw_uid, 0o600)
        assert sorted(p.name for p in home.iterdir() if p.name.startswith(".")) == []
    finally:
        shutil.rmtree(vault, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (datadir / f".pg_hba.conf.{os.getpid()}").unlink()


def test_the_lock_is_roots_alone_and_an_old_shared_one_cannot_block_a_stop(home: Path) -> None:
    pw = _require_root()
    if shutil.which("flock") is None:
        pytest.fail("the test holds the lock with flock(1) (util-linux): install it")
    lock = home / "embedded.lock"
    embedded.status(home)
    info = lock.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o600)
    code, out = _run_as(pw, "sh", "-c", f"exec 3<{lock}")
    assert code != 0 and "Permission denied" in out, out

    # A lock file an older version made (0644): the postgres user opens it read-only and
    # holds its lock for ever. Root replaces it, and stops the server all the same.
    lock.chmod(0o644)
    holder = _as(pw, "flock", "--exclusive", str(lock), "-c", "echo held; cat")
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        assert embedded.stop(home) is True
        assert time.monotonic() - started < 30  # not the 60 s wait for a lock nobody frees
        info = lock.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o600)
    finally:
        holder.kill()
        holder.communicate(timeout=BOUND_S)  # reaped, its pipes closed
        embedded.ensure_running(home)  # for the tests after this one


def test_a_home_another_user_may_write_is_refused(tmp_path: Path) -> None:
    pw = _require_root()
    for owner, mode in ((pw.pw_uid, 0o755), (0, 0o777)):
        home = _new_home()
        try:
            os.chown(home, owner, -1)
            home.chmod(mode)
            with pytest.raises(EmbeddedPostgresError) as caught:
                embedded.ensure_running(home, timeout=10)
            assert caught.value.code == "EMBEDDED_HOME_UNSAFE", caught.value
            assert "chown root" in str(caught.value)
            assert not (home / "pgdata").exists()
        finally:
            shutil.rmtree(home, ignore_errors=True)


# ---- a role that changed its own password ----------------------------------------------


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.endswith("DATABASE_URL") and k not in {"DATABASE_URL", "WORKER_ENV"}
    }
    env |= {"WORKER_HOME": str(home), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [str(WORKER), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=BOUND_S * 3,
        check=False,
    )


async def test_a_role_whose_password_was_changed_is_named_with_the_fix(home: Path) -> None:
    migrated = _cli(home, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    server = embedded.ensure_running(home)
    reader = server.url(role="wq_reader")
    # A session of wq_reader changes its own password: Postgres allows it, whatever grants.
    with psycopg.connect(reader, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER ROLE wq_reader PASSWORD {}").format(sql.Literal("mine")))

    with pytest.raises(DatabaseUnreachable) as caught:
        await db.connect(reader)
    assert caught.value.code == "EMBEDDED_ROLE_PASSWORD_CHANGED"
    said = caught.value.render()
    assert "wq_reader" in said and str(home / "secret") in said and "worker migrate" in said

    listed = _cli(home, "runs", "list")  # a new process of that role: told at once
    assert listed.returncode == 6, listed.stderr
    first = listed.stderr.strip().splitlines()[-1]
    assert first.startswith("error[EMBEDDED_ROLE_PASSWORD_CHANGED]: "), listed.stderr
    assert "wq_reader" in first and "worker migrate" in first

    fixed = _cli(home, "migrate")  # the fix it names
    assert fixed.returncode == 0, fixed.stderr
    assert _cli(home, "runs", "list").returncode == 0
    await (await db.connect(reader)).close()
