"""What a user or a play wrote reaches the operator's terminal escaped: a play name, an org,
an exception's message, a traceback, an event kind carrying an OSC 52 clipboard write (or
a C1 CSI, a bidi override) is printed as visible escapes by every command that shows it,
and ``--json`` stays JSON with the same values and nothing raw."""

from __future__ import annotations

import json

import psycopg

from queues import outcomes, runs
from tests import attempts
from tests.e2e.test_cli_scheduler import cli

OSC52 = "\x1b]52;c;cm0gLXJmIH4=\x07"  # writes the clipboard
PLAY = f"evil{OSC52}"
ORG = "acme\x9b2J\u202e"  # a one-byte CSI (clear screen) and a right-to-left override
KIND = f"play.step{OSC52}"
RAW = ("\x1b", "\x07", "\x9b", "\u202e")


async def _run_a_play_wrote(url: str) -> str:
    """A failed run whose play name, org, exception and an event kind carry escapes (as
    rows written before any check, or by another writer, would)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        a = await attempts.start(conn)
        try:
            raise RuntimeError(f"boom{OSC52}")
        except RuntimeError as exc:
            error = outcomes.error_of(exc)
        policy = a.claimed.retry
        final = outcomes.failed(
            a.run_id, a.fence.attempt, error, policy, now=attempts.T0, failure=policy.max_attempts
        )
        await runs.finish(conn, worker_id=a.fence.owner, finishes=[final])
        await conn.execute(
            "UPDATE wq_runs SET play = %s, org = %s WHERE id = %s", (PLAY, ORG, a.run_id)
        )
        await conn.execute(
            "INSERT INTO wq_events (run_id, attempt, kind, seq)"
            " SELECT %s, 1, %s, max(seq) + 1 FROM wq_ledger WHERE run_id = %s",
            (a.run_id, KIND, a.run_id),
        )
        return str(a.run_id)


async def test_every_printer_escapes_what_a_play_wrote(db_url: str) -> None:
    run_id = await _run_a_play_wrote(db_url)
    shown = {}
    for args in (
        ("runs", "show", run_id),
        ("runs", "list"),
        ("events", run_id),
        ("result", run_id),
    ):
        done = await cli(db_url, *args)
        text = done.out + done.err
        assert not [c for c in RAW if c in text], (args, text)
        shown[args[:2]] = text
    show = shown["runs", "show"]
    assert "evil\\x1b]52;c;cm0gLXJmIH4=\\x07" in show  # the play, visibly
    assert "acme\\x9b2J\\u202e" in show  # the org
    assert "boom\\x1b]52" in show  # the exception's message, in the attempts and traceback
    assert "play.step\\x1b]52" in show  # the event kind
    assert "evil\\x1b]52" in shown["runs", "list"]
    assert "play.step\\x1b]52" in shown["events", run_id]

    as_json = await cli(db_url, "runs", "show", run_id, "--json")
    assert not [c for c in RAW if c in as_json.out], as_json.out
    data = json.loads(as_json.out)
    assert (data["play"], data["org"]) == (PLAY, ORG)  # the same values, only escaped
    assert KIND in [e["kind"] for e in data["events"]]
