"""A durable, release-pinned task-queue worker on Postgres: the public API.

Everything an application needs is importable from here::

    from worker import Registry, RunContext, Admitter, Submission

- :class:`Registry` and :class:`RunContext`: write plays (``@registry.play()``) and what a
  play may do (steps, sheets, events, sleeps);
- :class:`Admitter`, :class:`Submission`, :class:`Admitted`, :func:`submit` and
  :func:`submit_many`: admit runs (one atomic statement, one run or a batch; inside your
  own transaction too);
- :class:`InputPages` and :class:`Release`: a run's input rows and a checked release name;
- :class:`Sheet` and its values (:class:`RowCompletion`, :class:`AdmitResult`,
  :class:`Disposition`, :class:`CompletionResult`, :class:`StaleReason`,
  :class:`FenceReason`): a play's rows;
- :class:`Fatal`: raised by a play, it fails the run at once;
- the errors (:class:`WorkerError` and the classes below it) and :class:`ExitCode`.

Other modules are the implementation: they may change between releases.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it (imported on first use, so `import worker.x` stays
# cheap and free of import cycles)
_EXPORTS = {
    "Registry": "worker.plays",
    "RunContext": "worker.context",
    "Admitter": "queues.admission",
    "Submission": "queues.admission",
    "Admitted": "queues.admission",
    "submit": "queues.admission",
    "submit_many": "queues.admission",
    "InputPages": "queues.inputs",
    "Release": "queues.fields",
    "Retry": "queues.fields",
    "ChildFailed": "worker.context",
    "WaitTimedOut": "worker.context",
    "Sheet": "worker.context",
    "Fatal": "worker.endings",
    "RowCompletion": "queues.sheets",
    "Disposition": "queues.sheets",
    "StaleReason": "queues.sheets",
    "FenceReason": "queues.sheets",
    "AdmitResult": "queues.sheets",
    "CompletionResult": "queues.sheets",
    "SheetSuperseded": "queues.errors",
    "WriteIntentUnavailable": "queues.errors",
    "ExitCode": "queues.errors",
    "WorkerError": "queues.errors",
    "InputError": "queues.errors",
    "InvalidField": "queues.errors",
    "PayloadTooLarge": "queues.errors",
    "UnknownPlay": "queues.errors",
    "IdempotencyConflict": "queues.errors",
    "LaneNotPrepared": "queues.errors",
    "LaneDraining": "queues.errors",
    "LaneReclaimed": "queues.errors",
    "RunNotFound": "queues.errors",
    "StaleAttempt": "queues.errors",
    "SchemaContractMismatch": "queues.errors",
    "DatabaseUnreachable": "queues.errors",
}

__all__ = [
    "AdmitResult",
    "Admitted",
    "Admitter",
    "ChildFailed",
    "CompletionResult",
    "DatabaseUnreachable",
    "Disposition",
    "ExitCode",
    "Fatal",
    "FenceReason",
    "IdempotencyConflict",
    "InputError",
    "InputPages",
    "InvalidField",
    "LaneDraining",
    "LaneNotPrepared",
    "LaneReclaimed",
    "PayloadTooLarge",
    "Registry",
    "Release",
    "Retry",
    "RowCompletion",
    "RunContext",
    "RunNotFound",
    "SchemaContractMismatch",
    "Sheet",
    "SheetSuperseded",
    "StaleAttempt",
    "StaleReason",
    "Submission",
    "UnknownPlay",
    "WaitTimedOut",
    "WorkerError",
    "WriteIntentUnavailable",
    "submit",
    "submit_many",
]

if TYPE_CHECKING:
    from queues.admission import Admitted, Admitter, Submission, submit, submit_many
    from queues.errors import (
        DatabaseUnreachable,
        ExitCode,
        IdempotencyConflict,
        InputError,
        InvalidField,
        LaneDraining,
        LaneNotPrepared,
        LaneReclaimed,
        PayloadTooLarge,
        RunNotFound,
        SchemaContractMismatch,
        SheetSuperseded,
        StaleAttempt,
        UnknownPlay,
        WorkerError,
        WriteIntentUnavailable,
    )
    from queues.fields import Release, Retry
    from queues.inputs import InputPages
    from queues.sheets import (
        AdmitResult,
        CompletionResult,
        Disposition,
        FenceReason,
        RowCompletion,
        StaleReason,
    )
    from worker.context import ChildFailed, RunContext, Sheet, WaitTimedOut
    from worker.endings import Fatal
    from worker.plays import Registry


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
