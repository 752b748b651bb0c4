"""The attempt fence: what every write of an attempt carries and every statement checks.

A write of an attempt is applied only while its run is ``running``, at that attempt, under
that worker's lease; the statement that writes checks it, under a lock on the run's row.
A rescue (which skips locked runs and takes them at its next pass) or a newer claim (which
waits) closes the attempt only when no write of it is in flight, and a write that queues
behind the close re-reads the row and is refused: a write commits before its attempt is
closed, or never. Write versions separate *runs* of a sheet; they
cannot separate *attempts* of one run (a stable intent gives every attempt the same
version): only this fence does.

Where each write path checks it (all in ``sql/queries``):

========================  =======================================================
write                     statement
========================  =======================================================
step receipts             ``receipt_claim``, ``receipt_finish``,
                          ``receipt_complete_many`` (a page, or one step of the
                          run's own scope: ``receipts.record``),
                          ``receipt_extend_leases``, ``receipt_extend_for_attempts``
sheet rows                ``sheet_version_mint``, ``sheet_intent_claim``,
                          ``sheet_admit_rows``, ``sheet_complete_rows``
events                    ``event_emit`` (from a play)
ledger deliveries         ``ledger_append_delivered`` (the run-ledger token's actions;
                          the delivery lease named must be the live lease)
child runs                ``child_spawn`` (with its step's ``receipt_claim`` and
                          ``receipt_finish``, in one transaction)
rate-limit permits        ``limit_acquire``, ``limit_release``
budget reservations       ``budget_reserve`` (a step's charges ride on its receipt
                          write: ``receipt_finish``, ``receipt_complete_many``)
suspend, final outcome    ``run_finish_batch`` (plus: cancel is final)
lease renewal             ``run_heartbeat``
========================  =======================================================

A refused statement writes nothing but a row in ``wq_refusals`` (what ``worker metrics``
counts) and the caller raises :class:`~queues.errors.StaleAttempt`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from queues.errors import InvalidField, RunNotFound, StaleAttempt, WorkerError


@dataclass(frozen=True, slots=True)
class Fence:
    """One attempt's fencing token: its run, its attempt number, its lease owner."""

    run_id: UUID
    attempt: int
    owner: str  # the worker id that holds the run's lease

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, UUID):
            raise InvalidField(
                f"run_id is {self.run_id!r}",
                field="run_id",
                rule="a UUID",
                fix="pass the run id the claim returned",
            )
        if isinstance(self.attempt, bool) or not isinstance(self.attempt, int) or self.attempt < 1:
            raise InvalidField(
                f"attempt is {self.attempt!r}",
                field="attempt",
                rule="an integer >= 1",
                fix="pass the attempt number the run was claimed with",
            )
        if not isinstance(self.owner, str) or not self.owner:
            raise InvalidField(
                f"lease owner is {self.owner!r}",
                field="owner",
                rule="the non-empty id of the worker that holds the lease",
                fix="pass the worker id the run was claimed with",
            )

    def params(self, count: int = 1) -> dict[str, Any]:
        """The fence's named query parameters (``count``: the rows a refusal would log)."""
        return {"run_id": self.run_id, "attempt": self.attempt, "owner": self.owner, "count": count}


def refused(
    fence: Fence,
    *,
    verb: str,
    subject: str,
    run_attempt: int | None,
    run_state: str | None,
    reason: str | None = None,
) -> WorkerError:
    """The error for a write the fence refused: it names the run, the attempt and the write."""
    head = f"run {fence.run_id} attempt {fence.attempt} cannot {verb} {subject}"
    if run_attempt is None:
        return RunNotFound(f"{head}: the run does not exist", fix="check the run id")
    if reason is None:
        if run_attempt != fence.attempt or run_state != "running":
            reason = f"the run is now at attempt {run_attempt} ({run_state})"
        else:
            reason = f"the run's lease is no longer held by worker {fence.owner}"
    return StaleAttempt(
        f"{head}: {reason}; nothing was written",
        fix="stop this attempt; the attempt that owns the run now decides its outcome",
    )
