"""A run's ledger as its readers see it, for tests that assert on a run's events.

Readers read the view ``wq_ledger`` (through :func:`queues.runs.events`), not the table
``wq_events``: the lifecycle events that state rows record (run_created, attempt_started,
an attempt's outcome, a run's finishing event) are shown by the view from those rows and,
from the contract release on, are no longer written to the table (docs/design.md, 11b).
A test that reads the table would stop seeing them; one that reads here keeps its meaning.
"""

from __future__ import annotations

import uuid

from queues import runs
from tests.workers import connect


async def events(url: str, run_id: uuid.UUID | str, *kinds: str) -> list[runs.Event]:
    """The run's events in seq order; only those of ``kinds`` when any are given."""
    async with connect(url) as conn:
        found = await runs.events(conn, uuid.UUID(str(run_id)))
    return [e for e in found if not kinds or e.kind in kinds]


async def kinds(url: str, run_id: uuid.UUID | str) -> list[str]:
    """The kinds of the run's events in seq order."""
    return [e.kind for e in await events(url, run_id)]
