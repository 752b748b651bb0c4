"""A play's handle on one sheet (``ctx.sheet(name)``): admission pages and row completions.

The handle carries the attempt's write version from page to page; every page it sends is
fenced by the attempt.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from queues import calls, sheets
from worker.steps import Run


class Sheet:
    """A play's handle on one sheet: admit pages under a write version, complete rows.

    The stable write intent is opt-in, as in the reference runtime: with
    ``stable_intent=True`` every page, attempt and wake of the run reuses the run's durable
    write intent (``runtime_sheet_start_with_intent``). Without it an admission is legacy
    (``runtime_sheet_start``): it mints a version on the attempt's first page and reuses it
    for the attempt's later pages, so an attempt never supersedes its own earlier pages.
    """

    def __init__(self, run: Run, run_id: uuid.UUID, name: str) -> None:
        self._run = run
        self.run_id = run_id
        self.name = name
        self.write_version: int | None = None

    async def admit(
        self,
        rows: Sequence[tuple[str, Any]],
        *,
        stable_intent: bool = False,
        pending_rerun_admission: bool = True,
    ) -> sheets.AdmitResult:
        """Admit a page of ``(key, input)`` rows. ``stable_intent`` opts in to the run's
        durable write intent; ``pending_rerun_admission=False`` leaves rows pending under
        an older admission to it (``left_pending``) instead of re-admitting them.

        The opt-in travels as the action's name and a rerun admission is the receiver's
        default, so neither flag is sent unless it changes something: a receiver of the
        previous release, which refuses fields it does not define, serves these pages."""
        kind = calls.SheetStartWithIntent if stable_intent else calls.SheetStart
        result: sheets.AdmitResult = await self._run(
            kind(self.name, list(rows), self.write_version, pending_rerun_admission)
        )
        self.write_version = result.write_version
        return result

    async def complete(
        self, completions: Sequence[sheets.RowCompletion], *, raise_on_superseded: bool = False
    ) -> sheets.CompletionResult:
        """Complete a page of rows. Stale rows are reported, not raised, unless the writer
        asks (``raise_on_superseded=True`` or ``result.raise_if_superseded(...)``); the
        receiver's stop signal (``supersededKeys``: the attempt fence refused the page)
        always raises ``SheetSuperseded``, the attempt must stop."""
        result: sheets.CompletionResult = await self._run(
            calls.SheetComplete(self.name, list(completions), self.write_version)
        )
        result.raise_if_stopped(sheet=self.name, run_id=self.run_id)
        if raise_on_superseded:
            result.raise_if_superseded(sheet=self.name, run_id=self.run_id)
        return result
