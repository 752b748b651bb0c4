"""The committed ``sql/schema.sql`` is exactly what the migrations produce.

The dump runs ``scripts/dump_schema.py``'s own :func:`dump` against the session's migrated
template database, so the test and the script can never disagree on normalization.
"""

from __future__ import annotations

import difflib
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "dump_schema.py"
FIX = "sql/schema.sql is stale: run `.venv/bin/python scripts/dump_schema.py` and commit it"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dump_schema", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return _load_script()


def test_committed_schema_matches_the_migrations(script: ModuleType, template_url: str) -> None:
    committed_path: Path = script.SCHEMA_FILE
    assert committed_path == REPO / "sql" / "schema.sql"
    assert committed_path.exists(), FIX
    committed = committed_path.read_text(encoding="utf-8")
    current: str = script.dump(template_url)
    if current != committed:
        diff = "".join(
            difflib.unified_diff(
                committed.splitlines(keepends=True),
                current.splitlines(keepends=True),
                fromfile="sql/schema.sql (committed)",
                tofile="migrated template",
                n=2,
            )
        )
        pytest.fail(f"{FIX}\n{diff[:6000]}")


def test_dump_is_deterministic_and_free_of_volatile_lines(
    script: ModuleType, template_url: str
) -> None:
    first: str = script.dump(template_url)
    assert script.dump(template_url) == first
    for line in first.splitlines():
        assert not line.startswith(("\\restrict", "\\unrestrict", "SET ")), line
        assert "set_config(" not in line or not line.startswith("SELECT"), line
        assert not line.startswith("-- Dumped"), line
    # The schema is all there: procrastinate's, the tracking tables and ours.
    for table in ("procrastinate_jobs", "wq_migrations", "wq_schema_contract", "wq_runs"):
        assert f"CREATE TABLE public.{table} (" in first, table
    assert "\n\n\n" not in first


def test_normalize_strips_volatile_lines(script: ModuleType) -> None:
    raw = (
        "--\n-- PostgreSQL database dump\n--\n\n"
        "\\restrict AbCdEf123\n\n"
        "-- Dumped from database version 18.1\n"
        "-- Dumped by pg_dump version 18.1\n\n"
        "SET statement_timeout = 0;\n"
        "SET client_encoding = 'UTF8';\n"
        "SELECT pg_catalog.set_config('search_path', '', false);\n\n\n\n"
        "CREATE TABLE public.t (\n    id integer   \n);\n\n"
        "\\unrestrict AbCdEf123\n\n"
    )
    out: str = script.normalize(raw)
    assert out.startswith(script.HEADER)
    body = out.removeprefix(script.HEADER)
    assert body == (
        "\n--\n-- PostgreSQL database dump\n--\n\nCREATE TABLE public.t (\n    id integer\n);\n"
    )
    # The same schema with another random key and server version normalizes identically.
    other = raw.replace("AbCdEf123", "ZzYyXx987").replace("18.1", "18.3")
    assert script.normalize(other) == out


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def test_check_flag_reports_drift(script: ModuleType, pg_admin_url: str, tmp_path: Path) -> None:
    target = tmp_path / "schema.sql"
    target.write_text(script.SCHEMA_FILE.read_text(encoding="utf-8"), encoding="utf-8")
    args = [sys.executable, str(SCRIPT), "--admin-url", pg_admin_url, "--output", str(target)]
    ok = run([*args, "--check"])
    assert ok.returncode == 0, ok.stdout + ok.stderr

    edited = target.read_text().replace("TABLE public.wq_runs (", "TABLE public.wq_rnus (")
    target.write_text(edited, encoding="utf-8")
    drift = run([*args, "--check"])
    assert drift.returncode == 1, drift.stdout + drift.stderr
    assert "-CREATE TABLE public.wq_rnus (" in drift.stdout
    assert "scripts/dump_schema.py" in drift.stdout

    target.unlink()
    wrote = run(args)
    assert wrote.returncode == 0, wrote.stderr
    assert target.read_text(encoding="utf-8") == script.SCHEMA_FILE.read_text(encoding="utf-8")
