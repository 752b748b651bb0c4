"""One set of field rules at every entry point: the Python API, the CLI and a direct call of
the submit functions (the admission role's) refuse the same bad values with the same code.

The database is the last line: what the admission role may call directly (``wq_submit``,
``wq_submit_many``, ``wq_submit_with_options``, migration 0036) refuses what the Python
API refuses, with the same error code and field (its SQLSTATEs map onto the same error
classes), and writes nothing. The numbers and patterns the database checks against are
the Python rules' own (``wq_field_rules()`` equals ``queues.admission.database_rules()``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from queues import admission, fields, lanes
from queues.authority import EXECUTOR_CAPABILITIES, LEDGER_PROJECT
from queues.errors import WorkerError, translate
from tests.workers import ROOT, connect, fetch, login_users

WORKER = str(Path(sys.executable).parent / "worker")
RELEASE = "t"
SUBMIT = (
    "SELECT * FROM wq_submit(%(id)s, %(org)s, %(play)s, %(params)s, %(release)s, %(lane)s,"
    " %(key)s, %(priority)s, %(authority)s, NULL, NULL, NULL)"
)


def nested(levels: int) -> dict[str, Any]:
    """A JSON object nested ``levels`` deep (counting itself)."""
    value: Any = {}
    for _ in range(levels - 2):
        value = [value]
    return {"a": value}


@dataclass(frozen=True)
class Bad:
    """One bad value for one field of a submission, and the code every entry point answers
    it with. ``cli``: whether the CLI can express it (it has no authority flag)."""

    id: str
    code: str
    field: str
    play: Any = "noop"
    params: Any = field(default_factory=dict)
    release: Any = RELEASE
    org: Any = "default"
    key: Any = None
    priority: Any = 0
    authority: Any = None
    cli: bool = True


CASES = [
    Bad("params-array", "FIELD_INVALID", "params", params=[1, 2]),
    Bad("params-string", "FIELD_INVALID", "params", params="limit=10"),
    Bad("params-30mb", "PAYLOAD_TOO_LARGE", "params", params={"a": "x" * 30_000_000}),
    Bad("params-too-deep", "FIELD_INVALID", "params", params=nested(fields.MAX_JSON_DEPTH + 1)),
    Bad("play-ansi-escape", "FIELD_INVALID", "play", play="\x1b[31mnoop"),
    Bad("play-upper-case", "FIELD_INVALID", "play", play="Noop"),
    Bad("play-too-long", "FIELD_INVALID", "play", play="p" * (fields.MAX_PLAY + 1)),
    Bad("org-ansi-escape", "FIELD_INVALID", "org", org="acme\x1b[2J\x1b[H"),
    Bad("org-100k", "FIELD_INVALID", "org", org="o" * 100_000),
    Bad("org-empty", "FIELD_INVALID", "org", org=""),
    Bad("org-zero-width-space", "FIELD_INVALID", "org", org="ac\u200bme"),
    Bad("org-bidi-override", "FIELD_INVALID", "org", org="acme\u202egnp.exe"),
    Bad("key-ansi-escape", "FIELD_INVALID", "idempotency_key", key="k\x1b]0;owned\x07"),
    Bad("key-too-long", "FIELD_INVALID", "idempotency_key", key="k" * 201),
    Bad("release-unsafe", "FIELD_INVALID", "release", release="v1;drop"),
    Bad("release-too-long", "FIELD_INVALID", "release", release="r" * (fields.MAX_RELEASE + 1)),
    Bad("priority-out-of-range", "FIELD_INVALID", "priority", priority=1_000_001),
    Bad("authority-array", "FIELD_INVALID", "authority", authority=[1], cli=False),
    Bad(
        "authority-500kb",
        "PAYLOAD_TOO_LARGE",
        "authority",
        authority={"note": "x" * 500_000},
        cli=False,
    ),
]


def descriptor(run_id: uuid.UUID, org: Any, play: Any, release: Any) -> dict[str, Any]:
    """The authority admission stores with a run."""
    return {
        "run": str(run_id),
        "org": org,
        "play": play,
        "release": release,
        "capabilities": list(EXECUTOR_CAPABILITIES),
    }


def sql_args(case: Bad) -> dict[str, Any]:
    """The case as a direct call of wq_submit passes it (the lane of its release)."""
    run_id = uuid.uuid4()
    authority = (
        case.authority
        if case.authority is not None and not isinstance(case.authority, dict)
        else descriptor(run_id, case.org, case.play, case.release) | (case.authority or {})
    )
    return {
        "id": run_id,
        "org": case.org,
        "play": case.play,
        "params": Jsonb(case.params),
        "release": case.release,
        "lane": f"r-{case.release}",
        "key": case.key,
        "priority": case.priority,
        "authority": Jsonb(authority),
    }


async def by_sql(url: str, statement: str, args: dict[str, Any]) -> WorkerError | None:
    """Call a submit function directly; the error it raised, as the error tree has it."""
    async with connect(url) as conn:
        try:
            await conn.execute(statement, args)
        except psycopg.Error as exc:
            mapped = translate(exc)
            assert mapped is not None, f"an error outside the tree: {exc!r}"
            return mapped
    return None


async def by_api(url: str, case: Bad) -> WorkerError | None:
    sub = admission.Submission(
        play=case.play,
        params=case.params,
        release=case.release,
        org=case.org,
        idempotency_key=case.key,
        priority=case.priority,
    )
    async with connect(url) as conn:
        try:
            await admission.submit(conn, sub, authority=case.authority)
        except WorkerError as exc:
            return exc
    return None


async def by_cli(url: str, case: Bad, tmp: Path) -> str | None:
    """``worker submit`` with the case's values; the code of its ``error[CODE]`` line."""
    args = [WORKER, "submit", case.play, "--release", case.release, "--org", case.org]
    if len(json.dumps(case.params)) > 100_000:  # past what one argument may hold
        path = tmp / f"{case.id}.json"
        path.write_text(json.dumps(case.params))
        args += ["--params-file", str(path)]
    else:
        args += ["--params", json.dumps(case.params)]
    if case.key is not None:
        args += ["--idempotency-key", case.key]
    args += ["--priority", str(case.priority)]
    proc = await asyncio.create_subprocess_exec(
        *args,
        env=dict(os.environ, WORKER_DATABASE_URL=url, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    found = re.search(r"error\[([A-Z_]+)\]", err.decode(errors="replace"))
    if proc.returncode == 0 or found is None:
        return None
    assert proc.returncode == 2, (case.id, proc.returncode, err.decode()[-500:])
    return found[1]


async def test_every_entry_point_refuses_each_bad_value_with_the_same_code(
    db_url: str, tmp_path: Path
) -> None:
    async with connect(db_url) as owner:
        await lanes.prepare(owner, RELEASE)
    wrong: list[str] = []
    async with login_users(db_url, ["wq_admission"]) as urls:
        admitter = urls["wq_admission"]
        for case in CASES:
            api = await by_api(admitter, case)
            direct = await by_sql(admitter, SUBMIT, sql_args(case))
            for where, got in (("api", api), ("sql", direct)):
                if got is None or (got.code, got.field) != (case.code, case.field):
                    shown = None if got is None else (got.code, got.field, got.message[:120])
                    wrong.append(f"{case.id} by {where}: {shown}")
        gate = asyncio.Semaphore(2)

        async def cli(case: Bad) -> None:
            async with gate:
                code = await by_cli(db_url, case, tmp_path)
            if code != case.code:
                wrong.append(f"{case.id} by cli: {code}")

        await asyncio.gather(*(cli(case) for case in CASES if case.cli))
    assert not wrong, "\n".join(wrong)
    assert await fetch(db_url, "SELECT count(*) FROM wq_runs") == [(0,)]


@dataclass(frozen=True)
class Direct:
    """A value only a direct call can send (the API makes these itself); refused all the
    same."""

    id: str
    code: str
    field: str
    statement: str
    args: dict[str, Any]


def submit_args(
    *, authority_changes: dict[str, Any] | None = None, **changes: Any
) -> dict[str, Any]:
    """A direct call's arguments: a good submission with ``changes``; its authority the one
    admission would store for it, with ``authority_changes``."""
    args = {
        "id": uuid.uuid4(),
        "org": "default",
        "play": "noop",
        "params": Jsonb({}),
        "release": RELEASE,
        "lane": f"r-{RELEASE}",
        "key": None,
        "priority": 0,
    } | changes
    if "authority" not in changes:
        stored = descriptor(args["id"], args["org"], args["play"], args["release"])
        args["authority"] = Jsonb(stored | (authority_changes or {}))
    return args


WITH_OPTIONS = (
    "SELECT * FROM wq_submit_with_options(%(id)s, %(org)s, %(play)s, %(params)s, %(release)s,"
    " %(lane)s, %(key)s, %(priority)s, %(authority)s, NULL, NULL, NULL, %(options)s)"
)
MANY = (
    "SELECT * FROM wq_submit_many(%(ids)s, %(orgs)s, %(plays)s, %(params)s::jsonb[],"
    " %(releases)s, %(lanes)s, %(keys)s, %(priorities)s, %(authorities)s::jsonb[])"
)


def many_args(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "ids": [r["id"] for r in rows],
        "orgs": [r["org"] for r in rows],
        "plays": [r["play"] for r in rows],
        "params": [r["params"] for r in rows],
        "releases": [r["release"] for r in rows],
        "lanes": [r["lane"] for r in rows],
        "keys": [r["key"] for r in rows],
        "priorities": [r["priority"] for r in rows],
        "authorities": [r["authority"] for r in rows],
    }


def options(value: Any) -> dict[str, Any]:
    return submit_args(options=Jsonb(value))


DIRECT = [
    Direct("lane-of-another-release", "FIELD_INVALID", "lane", SUBMIT, submit_args(lane="r-v2")),
    Direct("org-null", "FIELD_INVALID", "org", SUBMIT, submit_args(org=None)),
    Direct("params-null", "FIELD_INVALID", "params", SUBMIT, submit_args(params=None)),
    Direct(
        "params-integer-beyond-python",
        "FIELD_INVALID",
        "params",
        SUBMIT,
        submit_args(params=Jsonb({}, dumps=lambda _: '{"n": 1' + "0" * 5000 + "}")),
    ),
    Direct(
        "authority-of-another-org",
        "FIELD_INVALID",
        "authority",
        SUBMIT,
        submit_args(authority_changes={"org": "someone-else"}),
    ),
    Direct(
        "authority-of-another-run",
        "FIELD_INVALID",
        "authority",
        SUBMIT,
        submit_args(authority_changes={"run": str(uuid.uuid4())}),
    ),
    Direct(
        "authority-grants-more",
        "FIELD_INVALID",
        "authority",
        SUBMIT,
        submit_args(authority_changes={"capabilities": [*EXECUTOR_CAPABILITIES, LEDGER_PROJECT]}),
    ),
    Direct(
        "authority-capabilities-not-names",
        "FIELD_INVALID",
        "authority",
        SUBMIT,
        submit_args(authority_changes={"capabilities": [{"sheet.write": True}]}),
    ),
    Direct(
        "batch-with-one-bad-org",
        "FIELD_INVALID",
        "org",
        MANY,
        many_args([submit_args(), submit_args(org="x\x1b[2J"), submit_args()]),
    ),
    Direct(
        "batch-arrays-of-other-lengths",
        "FIELD_INVALID",
        "org",
        MANY,
        many_args([submit_args(), submit_args()]) | {"orgs": ["default"]},
    ),
    Direct(
        "batch-params-array",
        "FIELD_INVALID",
        "params",
        MANY,
        many_args([submit_args(params=Jsonb([1]))]),
    ),
    Direct("options-not-object", "FIELD_INVALID", "options", WITH_OPTIONS, options([1])),
    Direct(
        "options-max-attempts-zero",
        "FIELD_INVALID",
        "max_attempts",
        WITH_OPTIONS,
        options({"max_attempts": 0}),
    ),
    Direct(
        "options-retry-kind",
        "FIELD_INVALID",
        "retry",
        WITH_OPTIONS,
        options({"retry": {"kind": "sometimes"}}),
    ),
    Direct(
        "options-retry-factor",
        "FIELD_INVALID",
        "retry",
        WITH_OPTIONS,
        options({"retry": {"kind": "exponential", "factor": 1e9}}),
    ),
    Direct(
        "options-timeout-negative",
        "FIELD_INVALID",
        "timeout",
        WITH_OPTIONS,
        options({"timeout_s": -1}),
    ),
    Direct("options-meta-array", "FIELD_INVALID", "meta", WITH_OPTIONS, options({"meta": [1]})),
    Direct(
        "options-meta-large",
        "PAYLOAD_TOO_LARGE",
        "meta",
        WITH_OPTIONS,
        options({"meta": {"a": "x" * 100_000}}),
    ),
    Direct(
        "options-bad-params",
        "FIELD_INVALID",
        "params",
        WITH_OPTIONS,
        submit_args(params=Jsonb("x"), options=Jsonb({"max_attempts": 2})),
    ),
]


async def test_a_direct_call_refuses_what_only_it_can_send_and_admits_the_api_edges(
    db_url: str,
) -> None:
    """What only a direct call can send is refused all the same; and the database refuses
    nothing the API takes: each limit at its edge, and the JSON the database stores in the
    most bytes for its text (one-digit numbers), as large as the API takes it."""
    release = "r" * fields.MAX_RELEASE
    async with connect(db_url) as owner:
        await lanes.prepare(owner, RELEASE)
        await lanes.prepare(owner, release)
    wrong = []
    async with login_users(db_url, ["wq_admission"]) as urls:
        for case in DIRECT:
            got = await by_sql(urls["wq_admission"], case.statement, case.args)
            if got is None or (got.code, got.field) != (case.code, case.field):
                shown = None if got is None else (got.code, got.field, got.message[:120])
                wrong.append(f"{case.id}: {shown}")
            elif not got.fix or "nothing was written" not in got.message:
                wrong.append(f"{case.id}: no fix or no word of what was written: {got!r}")
        assert not wrong, "\n".join(wrong)
        assert await fetch(db_url, "SELECT count(*) FROM wq_runs") == [(0,)]

        params = {"a": [0] * ((fields.MAX_PARAMS_BYTES - 8) // 2)}
        assert len(admission.encode_params(params)) <= fields.MAX_PARAMS_BYTES
        assert fields.depth(nested(fields.MAX_JSON_DEPTH)) == fields.MAX_JSON_DEPTH
        edges = [
            submit_args(params=Jsonb(params)),
            submit_args(params=Jsonb(nested(fields.MAX_JSON_DEPTH))),
            submit_args(org="o" * fields.MAX_ORG, key="k" * fields.MAX_IDEMPOTENCY_KEY),
            submit_args(org="\U0001f468\u200d\U0001f469 family"),  # a joiner is text
            submit_args(priority=fields.PRIORITY_RANGE[0]),
            submit_args(priority=fields.PRIORITY_RANGE[1]),
            submit_args(play="p" * fields.MAX_PLAY, release=release, lane=f"r-{release}"),
        ]
        for args in edges:
            assert await by_sql(urls["wq_admission"], SUBMIT, args) is None
        api = admission.Submission(play="noop", params=params, release=RELEASE, org="o" * 100)
        async with connect(urls["wq_admission"]) as conn:
            admitted = await admission.submit(conn, api, authority={"note": "y" * 60_000})
        assert admitted.created
    assert await fetch(db_url, "SELECT count(*) FROM wq_runs") == [(len(edges) + 1,)]


async def test_the_database_checks_against_the_python_rules(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """One source of the limits: the database's rules are the Python rules' numbers."""
    cur = await conn.execute("SELECT wq_field_rules()")
    assert await cur.fetchone() == (admission.database_rules(),)
