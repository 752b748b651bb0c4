"""Bad input, tried as a careless or hostile user would: every case is refused with
``error[CODE]``, the exit status of its row in the table, no traceback, and no row written
in any table of the database.

Each case runs the installed ``worker`` console script in a subprocess against a migrated
database (one per module; its row counts are compared around every case).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from tests.conftest import clone_database, drop_database

WORKER = str(Path(sys.executable).parent / "worker")
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/x"
DEEP = "[" * 10_000 + "]" * 10_000  # JSON nested 10,000 levels deep
URL_VARIABLES = ("DATABASE_URL", "WORKER_DATABASE_URL", "WORKER_APP", "VERCEL", "WORKER_ENV")

Arg = str | bytes
_databases = itertools.count()


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[Arg, ...]
    code: str
    exit: int = 2
    # Files the case needs, by name: written into the case's directory first.
    files: dict[str, str | bytes] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def app(name: str, body: str) -> dict[str, str | bytes]:
    return {f"{name}.py": body}


CASES = [
    # ---- an --app that cannot be loaded
    Case(
        "app-raises-on-import",
        ("submit", "noop", "--app", "raising:plays"),
        "APP_INVALID",
        files=app("raising", "raise RuntimeError('boom at import')\n"),
    ),
    Case(
        "app-syntax-error",
        ("submit", "noop", "--app", "broken:plays"),
        "APP_INVALID",
        files=app("broken", "def plays(:\n"),
    ),
    Case(
        "app-calls-sys-exit",
        ("submit", "noop", "--app", "exiting:plays"),
        "APP_INVALID",
        files=app("exiting", "import sys\nsys.exit(7)\n"),
    ),
    Case("app-relative-path", ("submit", "noop", "--app", "../x:y"), "APP_INVALID"),
    Case("app-not-a-registry", ("submit", "noop", "--app", "json:dumps"), "APP_INVALID"),
    Case("app-missing", ("submit", "noop", "--app", "no_such_module:plays"), "APP_INVALID"),
    # ---- JSON nested too deep, everywhere JSON enters
    Case("params-deep", ("submit", "noop", "--params", DEEP), "FIELD_INVALID"),
    Case(
        "params-file-deep",
        ("submit", "noop", "--params-file", "{dir}/deep.json"),
        "FIELD_INVALID",
        files={"deep.json": DEEP},
    ),
    Case("payload-deep", ("emit", "paid", "--payload", DEEP), "FIELD_INVALID"),
    Case(
        "jsonl-row-deep",
        ("submit", "noop", "--input", "{dir}/rows.jsonl"),
        "FIELD_INVALID",
        files={"rows.jsonl": '{"id": "a"}\n{"id": "b", "x": ' + DEEP + "}\n"},
    ),
    # ---- text that is not valid UTF-8 (argv decoded with surrogateescape)
    Case("play-not-utf8", ("submit", b"no\xffop"), "FIELD_INVALID"),
    Case("org-not-utf8", ("submit", "noop", "--org", b"ac\xffme"), "FIELD_INVALID"),
    Case("key-not-utf8", ("submit", "noop", "--idempotency-key", b"k\xff"), "FIELD_INVALID"),
    Case("event-not-utf8", ("emit", b"pa\xffid"), "FIELD_INVALID"),
    # ---- files that are not files
    Case(
        "params-file-proc", ("submit", "noop", "--params-file", "/proc/self/mem"), "FIELD_INVALID"
    ),
    Case("input-dev-zero", ("submit", "noop", "--input", "/dev/zero"), "FIELD_INVALID"),
    Case("input-directory", ("submit", "noop", "--input", "{dir}"), "FIELD_INVALID"),
    Case(
        "params-file-missing",
        ("submit", "noop", "--params-file", "{dir}/nope.json"),
        "FIELD_INVALID",
    ),
    # ---- names
    Case("release-newline", ("submit", "noop", "--release", "v1\n"), "FIELD_INVALID"),
    Case("release-empty", ("submit", "noop", "--release", ""), "FIELD_INVALID"),
    Case("release-unsafe", ("queues", "drain", "v1;drop"), "FIELD_INVALID"),
    Case("play-empty", ("submit", ""), "FIELD_INVALID"),
    Case("play-newline", ("submit", "noop\n"), "FIELD_INVALID"),
    Case("play-100kb", ("submit", "p" * 100_000), "FIELD_INVALID"),
    Case("org-control-char", ("submit", "noop", "--org", "ac\x07me"), "FIELD_INVALID"),
    Case("key-too-long", ("submit", "noop", "--idempotency-key", "k" * 10_000), "FIELD_INVALID"),
    Case("event-empty", ("emit", ""), "FIELD_INVALID"),
    Case("event-newline", ("emit", "paid\n"), "FIELD_INVALID"),
    Case("event-100kb", ("emit", "e" * 100_000), "FIELD_INVALID"),
    # ---- values Postgres cannot store, refused before they reach it
    Case("params-nul", ("submit", "noop", "--params", '{"a": "x\\u0000y"}'), "FIELD_INVALID"),
    Case("params-surrogate", ("submit", "noop", "--params", '{"a": "\\ud800"}'), "FIELD_INVALID"),
    Case("params-nan", ("submit", "noop", "--params", '{"a": NaN}'), "FIELD_INVALID"),
    Case("params-not-object", ("submit", "noop", "--params", "[1, 2]"), "FIELD_INVALID"),
    Case("params-not-json", ("submit", "noop", "--params", "{a: 1}"), "FIELD_INVALID"),
    Case(
        "params-too-large",
        ("submit", "noop", "--params-file", "{dir}/big.json"),
        "PAYLOAD_TOO_LARGE",
        files={"big.json": json.dumps({"a": "x" * 300_000})},
    ),
    Case("payload-nan", ("emit", "paid", "--payload", "NaN"), "FIELD_INVALID"),
    # ---- input rows
    Case(
        "csv-duplicate-header",
        ("submit", "noop", "--input", "{dir}/rows.csv"),
        "FIELD_INVALID",
        files={"rows.csv": "id,id\n1,2\n"},
    ),
    Case(
        "csv-empty",
        ("submit", "noop", "--input", "{dir}/rows.csv"),
        "FIELD_INVALID",
        files={"rows.csv": ""},
    ),
    Case(
        "csv-header-only",
        ("submit", "noop", "--input", "{dir}/rows.csv"),
        "FIELD_INVALID",
        files={"rows.csv": "id,name\n"},
    ),
    Case(
        "jsonl-duplicate-key",
        ("submit", "noop", "--input", "{dir}/rows.jsonl"),
        "FIELD_INVALID",
        files={"rows.jsonl": '{"id": "a"}\n{"id": "a"}\n'},
    ),
    Case(
        "jsonl-not-object",
        ("submit", "noop", "--input", "{dir}/rows.jsonl"),
        "FIELD_INVALID",
        files={"rows.jsonl": "[1]\n"},
    ),
    Case(
        "input-not-utf8",
        ("submit", "noop", "--input", "{dir}/rows.csv"),
        "FIELD_INVALID",
        files={"rows.csv": b"id,name\n1,\xff\n"},
    ),
    Case(
        "input-unknown-type",
        ("submit", "noop", "--input", "{dir}/rows.xlsx"),
        "FIELD_INVALID",
        files={"rows.xlsx": "id\n1\n"},
    ),
    # ---- durations and numbers
    Case("max-outage-nan", ("start", "--max-outage", "nan"), "FIELD_INVALID"),
    Case("grace-nan", ("start", "--grace", "nan"), "FIELD_INVALID"),
    Case("grace-negative", ("start", "--grace", "-1"), "FIELD_INVALID"),
    Case("metrics-window-nan", ("metrics", "--window", "nan"), "FIELD_INVALID"),
    Case("recover-every-inf", ("recover", "--every", "inf"), "FIELD_INVALID"),
    Case(
        "result-timeout-nan",
        ("result", "00000000-0000-0000-0000-000000000000", "--wait", "--timeout", "nan"),
        "FIELD_INVALID",
    ),
    Case(
        "submit-wait-timeout-without-wait",
        ("submit", "noop", "--wait-timeout", "5s"),
        "FIELD_INVALID",
    ),
    # ---- a run's own options, rate limits, schedules
    Case("submit-max-attempts-zero", ("submit", "noop", "--max-attempts", "0"), "FIELD_INVALID"),
    Case("submit-retry-unknown", ("submit", "noop", "--retry", "sometimes"), "FIELD_INVALID"),
    Case(
        "submit-retry-cap-below-base",
        ("submit", "noop", "--retry", "exponential:base=1m,cap=1s"),
        "FIELD_INVALID",
    ),
    Case("submit-run-timeout-nan", ("submit", "noop", "--timeout", "nan"), "FIELD_INVALID"),
    Case("submit-start-by-vague", ("submit", "noop", "--start-by", "tomorrow"), "FIELD_INVALID"),
    Case(
        "submit-start-by-no-offset",
        ("submit", "noop", "--start-by", "2030-01-01T09:00:00"),
        "FIELD_INVALID",
    ),
    Case("submit-meta-not-object", ("submit", "noop", "--meta", "[1]"), "FIELD_INVALID"),
    Case("submit-budget-negative", ("submit", "noop", "--budget", "-5"), "FIELD_INVALID"),
    Case("submit-budget-period", ("submit", "noop", "--budget", "5:usd:week"), "FIELD_INVALID"),
    Case("submit-priority-text", ("submit", "noop", "--priority", "high"), "FIELD_INVALID"),
    Case("limit-without-rate-or-cap", ("limits", "set", "api"), "FIELD_INVALID"),
    Case("limit-bad-rate", ("limits", "set", "api", "--rate", "10/x"), "FIELD_INVALID"),
    Case("limit-bad-key", ("limits", "set", "API Key", "--rate", "1/s"), "FIELD_INVALID"),
    Case("schedule-without-timing", ("schedules", "add", "s", "--play", "noop"), "FIELD_INVALID"),
    Case(
        "schedule-bad-cron",
        ("schedules", "add", "s", "--play", "noop", "--cron", "99 * * * *"),
        "FIELD_INVALID",
    ),
    # ---- runs that do not exist, usage
    Case("result-not-a-uuid", ("result", "nope"), "FIELD_INVALID"),
    Case(
        "cancel-unknown-run",
        ("cancel", "00000000-0000-0000-0000-000000000000"),
        "RUN_NOT_FOUND",
    ),
    Case("unknown-flag", ("submit", "noop", "--no-such-flag"), "USAGE_INVALID"),
    # ---- the database
    Case(
        "database-unreachable",
        ("submit", "noop"),
        "DATABASE_UNREACHABLE",
        exit=6,
        env={"WORKER_DATABASE_URL": UNREACHABLE},
    ),
]


def environment(db_url: str, extra: dict[str, str], path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in URL_VARIABLES}
    env["WORKER_DATABASE_URL"] = db_url
    env["PYTHONPATH"] = f"{path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.update(extra)
    return env


def run_worker(
    args: tuple[Arg, ...], env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [WORKER.encode(), *(a.encode() if isinstance(a, str) else a for a in args)],
        env=env,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


async def row_counts(url: str) -> dict[str, int]:
    """Rows in every table of the database (ours and procrastinate's)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
        )
        tables = [str(t) for (t,) in await cur.fetchall()]
        counts: dict[str, int] = {}
        for table in tables:
            cur = await conn.execute(f'SELECT count(*) FROM "{table}"')
            row = await cur.fetchone()
            assert row is not None
            counts[table] = int(row[0])
        return counts


@pytest.fixture
async def database(pg_admin_url: str, template_url: str) -> AsyncIterator[str]:
    name = f"wq_bad_input_{os.getpid()}_{next(_databases)}"
    url = await clone_database(pg_admin_url, name)
    try:
        yield url
    finally:
        await drop_database(pg_admin_url, name)


def check_refused(res: subprocess.CompletedProcess[bytes], code: str, exit_status: int) -> str:
    stderr = res.stderr.decode(errors="replace")
    stdout = res.stdout.decode(errors="replace")
    detail = f"exit {res.returncode}\nstdout:\n{stdout[-2000:]}\nstderr:\n{stderr[-2000:]}"
    assert res.returncode == exit_status, detail
    assert f"error[{code}]" in stderr, detail
    assert "Traceback" not in stderr + stdout, detail
    return stderr


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_bad_input_is_refused_cleanly_and_writes_nothing(
    database: str, tmp_path: Path, case: Case
) -> None:
    for name, content in case.files.items():
        target = tmp_path / name
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    args = tuple(a.replace("{dir}", str(tmp_path)) if isinstance(a, str) else a for a in case.args)
    before = await row_counts(database)
    res = run_worker(args, environment(database, case.env, tmp_path))
    stderr = check_refused(res, case.code, case.exit)
    if case.exit == 2 and case.code != "USAGE_INVALID":
        # The promised shape: what, the field and its rule, and the fix.
        assert "Fix:" in stderr, stderr
    assert await row_counts(database) == before


# ---- cases that need a state first ------------------------------------------------------------


async def test_a_reused_key_with_other_input_rows_is_a_conflict(
    database: str, tmp_path: Path
) -> None:
    env = environment(database, {}, tmp_path)
    (tmp_path / "a.csv").write_text("id,name\n1,ada\n2,bob\n")
    (tmp_path / "b.csv").write_text("id,name\n1,ada\n2,eve\n")
    base = ("submit", "noop", "--idempotency-key", "k1", "--release", "ik", "--json")
    first = run_worker((*base, "--input", str(tmp_path / "a.csv")), env)
    assert first.returncode == 0, first.stderr
    again = run_worker((*base, "--input", str(tmp_path / "a.csv")), env)
    assert again.returncode == 0, again.stderr
    assert json.loads(first.stdout)["run_id"] == json.loads(again.stdout)["run_id"]
    assert json.loads(again.stdout)["created"] is False
    before = await row_counts(database)
    other = run_worker((*base, "--input", str(tmp_path / "b.csv")), env)
    check_refused(other, "IDEMPOTENCY_CONFLICT", 2)
    assert await row_counts(database) == before


async def test_commands_refuse_a_database_behind_the_code(database: str, tmp_path: Path) -> None:
    """emit, cancel and drain check the schema contract before writing, like submit."""
    async with await psycopg.AsyncConnection.connect(database, autocommit=True) as conn:
        # Behind: its newest migration this code needs is missing (the history decides,
        # the record summarises it; a trailing contract step the code does not need).
        await conn.execute(
            "DELETE FROM wq_migrations WHERE name ="
            " (SELECT max(name) FROM wq_migrations WHERE kind IS DISTINCT FROM 'contract')"
        )
        await conn.execute("UPDATE wq_schema_contract SET version = version - 1")
    env = environment(database, {}, tmp_path)
    before = await row_counts(database)
    for args in (
        ("emit", "paid"),
        ("cancel", "00000000-0000-0000-0000-000000000000"),
        ("queues", "drain", "v1"),
        ("queues", "prepare", "v1"),
        ("submit", "noop", "--release", "v1"),
    ):
        res = run_worker(args, env)
        stderr = check_refused(res, "SCHEMA_CONTRACT_MISMATCH", 1)
        assert "worker migrate" in stderr
    assert await row_counts(database) == before


def test_a_garbled_pg_version_is_named() -> None:
    home = Path(tempfile.mkdtemp(prefix="worker-garbled-", dir="/tmp"))
    try:
        home.chmod(0o755)  # the postgres user must reach it (root's tmp is private)
        (home / "pgdata").mkdir()
        (home / "pgdata" / "PG_VERSION").write_text("fifteen\n")
        env = {k: v for k, v in os.environ.items() if k not in URL_VARIABLES}
        env["WORKER_HOME"] = str(home)
        res = run_worker(("queues", "list"), env)
        stderr = check_refused(res, "EMBEDDED_START_FAILED", 1)
        assert "PG_VERSION" in stderr and "None" not in stderr
    finally:
        shutil.rmtree(home, ignore_errors=True)


# ---- memory: --input is streamed -------------------------------------------------------------

PEAK_RSS_LIMIT_MB = 150


def peak_rss_mb(args: tuple[str, ...], env: dict[str, str]) -> tuple[int, float, str]:
    """Run the console script in a child of a fresh interpreter, so the peak RSS measured is
    the command's alone (RUSAGE_CHILDREN of a process that has no other children)."""
    probe = (
        "import resource, subprocess, sys\n"
        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.stderr.write(r.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, WORKER, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    code, kib = out.stdout.split()
    return int(code), int(kib) / 1024, out.stderr


def write_rows(path: Path, n: int, line: Callable[[int], str]) -> Path:
    with path.open("w") as fh:
        fh.writelines(line(i) for i in range(n))
    return path


async def test_input_memory_stays_bounded_refused_or_admitted(
    database: str, tmp_path: Path
) -> None:
    env = environment(database, {}, tmp_path)
    million = write_rows(
        tmp_path / "million.jsonl", 1_000_000, lambda i: f'{{"id": "r{i}", "domain": "d{i}.com"}}\n'
    )
    code, peak, stderr = peak_rss_mb(("submit", "noop", "--input", str(million)), env)
    assert code == 2 and "error[PAYLOAD_TOO_LARGE]" in stderr, stderr
    assert peak < PEAK_RSS_LIMIT_MB, f"refusing 1,000,000 rows peaked at {peak:.0f} MB"

    most = write_rows(
        tmp_path / "most.csv", 200_000, lambda i: f"r{i},d{i}.com\n" if i else "id,domain\n"
    )
    code, peak, stderr = peak_rss_mb(
        ("submit", "noop", "--release", "mem", "--input", str(most)), env
    )
    assert code == 0, stderr
    assert peak < PEAK_RSS_LIMIT_MB, f"admitting 199,999 rows peaked at {peak:.0f} MB"
    async with await psycopg.AsyncConnection.connect(database, autocommit=True) as conn:
        cur = await conn.execute("SELECT input_rows FROM wq_runs")
        assert await cur.fetchall() == [(199_999,)]
