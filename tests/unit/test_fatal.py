"""What fails a run at once, the one rule for in-process and sandboxed plays
(``worker.endings.is_fatal``): the play's ``Fatal`` and the project's refusals, except a
refusal a later attempt may get past (an older receiver mid-rollout) and the database
going away."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import errors as pg

from queues.errors import (
    DatabaseUnreachable,
    InvalidField,
    PayloadTooLarge,
    WorkerError,
    WriteIntentUnavailable,
)
from worker.endings import is_fatal
from worker.plays import Fatal


@pytest.mark.parametrize(
    ("exc", "fatal"),
    [
        (Fatal("the play says so"), True),
        (InvalidField("bad", field="x"), True),
        (PayloadTooLarge("too big", field="x"), True),
        (WorkerError("a refusal"), True),
        # An older gateway during a rollout: retried with the run's policy, as the
        # refusal's own message asks.
        (WriteIntentUnavailable("older receiver", field="action"), False),
        # The database going away: an interruption.
        (DatabaseUnreachable("no database"), False),
        (pg.AdminShutdown("terminating"), False),
        (psycopg.OperationalError("closed"), False),
        # Anything else the play raises: a retried failure.
        (RuntimeError("a bug"), False),
        (KeyError("score"), False),
    ],
)
def test_what_fails_a_run_at_once(exc: BaseException, fatal: bool) -> None:
    assert is_fatal(exc) is fatal
