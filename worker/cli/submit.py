"""``worker submit``: admit a run of a play, or the runs of a --runs file, and wait for one.

Every flag's text is parsed here and checked by its one rule in :mod:`queues.admission`
(which names the flag in a refusal), before anything connects or writes; the submit
takes the checked submission as it is.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from queues import admission, costs, fields, inputs, lanes
from queues.errors import InputError, InvalidField, PayloadTooLarge
from worker import config
from worker.cli.common import (
    Conn,
    Duration,
    State,
    connected,
    emit_json,
    json_option,
    load_app,
    max_outage_option,
    pass_state,
    release_option,
)
from worker.cli.runs import timeout_needs_wait, wait_result
from worker.output import printable

# ---- the run-option flags -----------------------------------------------------------------------

# Each run-option flag: its field of RunFlags and of admission.Submission, the name click
# gives its value, and the flag as typed.
RUN_FLAGS = (
    ("max_attempts", "max_attempts", "--max-attempts"),
    ("retry", "retry", "--retry"),
    ("timeout", "run_timeout", "--timeout"),
    ("start_by", "start_by", "--start-by"),
    ("priority", "priority", "--priority"),
    ("meta", "meta", "--meta"),
    ("budget", "budget", "--budget"),
)
# The flag that sets each field of a submission, for its refusals (admission.check).
FLAG_NAMES = {"release": "--release"} | {name: flag for name, _, flag in RUN_FLAGS}


@dataclass(frozen=True, slots=True)
class RunFlags:
    """The run-option flags of ``worker submit`` as given: their text, unchecked (None:
    not given, the lane's policy). Their rules are the submission's, checked once by
    :func:`queues.admission.check`."""

    max_attempts: str | None = None
    retry: str | None = None
    timeout: str | None = None
    start_by: str | None = None
    priority: str | None = None
    meta: str | None = None
    budget: str | None = None

    def given(self) -> list[str]:
        """The flags given, as typed, in the order of ``--help``."""
        return [flag for name, _, flag in RUN_FLAGS if getattr(self, name) is not None]

    def submission(
        self,
        play: str,
        *,
        params: dict[str, Any],
        release: str,
        org: str,
        idempotency_key: str | None,
    ) -> admission.Submission:
        """A submission with these options, unchecked: each flag's text as given, --meta's
        parsed as JSON."""
        return admission.Submission(
            play=play,
            params=params,
            release=release,
            org=org,
            idempotency_key=idempotency_key,
            priority=0 if self.priority is None else self.priority,
            max_attempts=self.max_attempts,
            retry=self.retry,
            timeout=self.timeout,
            start_by=self.start_by,
            meta=None if self.meta is None else fields.decode(self.meta, field="--meta"),
            budget=None if self.budget is None else costs.RunBudget.parse(self.budget),
        )


_RUN_FLAG_OPTIONS = (
    click.option(
        "--max-attempts",
        default=None,
        metavar="N",
        help="Failed attempts this run may spend (default: its lane's policy).",
    ),
    click.option(
        "--retry",
        default=None,
        metavar="POLICY",
        help="This run's retry policy: none, fixed:30s, or "
        "exponential:base=2s,factor=2,cap=5m,jitter=0.1 (default: its lane's).",
    ),
    click.option(
        "--timeout",
        "run_timeout",
        default=None,
        metavar="DURATION",
        help="The run's timeout from its first start, over every attempt and sleep: past it "
        "the run is stopped and failed (RUN_TIMED_OUT). Default: its lane's (--run-timeout).",
    ),
    click.option(
        "--start-by",
        default=None,
        metavar="TIME|DURATION",
        help="Claim deadline: a run not started by then is failed (START_DEADLINE_PASSED), "
        "never run late; an ISO 8601 time with its offset, or a duration from now (10m).",
    ),
    click.option(
        "--priority",
        default=None,
        metavar="N",
        help="Higher runs first within its lane (default 0).",
    ),
    click.option(
        "--meta", default=None, metavar="JSON", help="A small JSON object kept with the run."
    ),
    click.option(
        "--budget",
        default=None,
        metavar="LIMIT[:UNIT[:PERIOD]]",
        help="The run's own budget: at most LIMIT of UNIT (credits) charged per PERIOD "
        "(day, month, none: the default); past it the run pauses (BUDGET_EXHAUSTED).",
    ),
)


def run_flags_option(command: Callable[..., None]) -> Callable[..., None]:
    """The run-option flags (--max-attempts, --retry, --timeout, --start-by, --priority,
    --meta, --budget), handed to ``command`` as one :class:`RunFlags` (its ``run_flags``)."""

    @functools.wraps(command)
    def with_flags(*args: Any, **kwargs: Any) -> None:
        given = {name: kwargs.pop(dest) for name, dest, _ in RUN_FLAGS}
        command(*args, run_flags=RunFlags(**given), **kwargs)

    decorated: Callable[..., None] = with_flags
    for option in reversed(_RUN_FLAG_OPTIONS):  # the first listed shows first in --help
        decorated = option(decorated)
    return decorated


# ---- reading the inputs -------------------------------------------------------------------------


def _read_params(params: str | None, params_file: Path | None) -> dict[str, Any]:
    if params and params_file:
        raise InvalidField(
            "both --params and --params-file given",
            field="--params",
            rule="one source of params",
            fix="pass only one of them",
        )
    text, source = (params, "--params") if params else (None, "--params-file")
    if params_file is not None:
        raw = _read_small_file(params_file, "--params-file", fields.MAX_PARAMS_BYTES)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise InvalidField(
                f"--params-file {params_file.name} is not UTF-8 (line {line})",
                field="--params-file",
                rule="a UTF-8 JSON file",
                fix="re-save the file as UTF-8",
            ) from exc
    if not text:
        return {}
    value = fields.decode(text, field=source)
    admission.encode_params(value)
    result: dict[str, Any] = value
    return result


def _read_small_file(path: Path, field: str, limit: int) -> bytes:
    """A small regular file's bytes, refused (never read to exhaustion) otherwise."""
    try:
        with open(path, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise InvalidField(
                    f"{path} is not a regular file",
                    field=field,
                    rule="a regular file",
                    fix="write the JSON to a file first",
                )
            raw = fh.read(limit + 1)
    except OSError as exc:
        raise InvalidField(
            f"cannot read {path}: {exc.strerror or exc}",
            field=field,
            rule="a readable regular file",
            fix="check the path and its permissions",
        ) from exc
    if len(raw) > limit:
        raise PayloadTooLarge(  # as the API and the database answer a value over its size
            f"{path} is larger than {limit} bytes",
            field=field,
            rule=f"at most {limit} bytes",
            fix="pass large inputs as sheet rows (--input) instead",
        )
    return raw


RUNS_FIELDS = frozenset({"play", "params", "release", "org", "idempotency_key", "priority"})
RUNS_BATCH = 1000  # submissions per wq_submit_many statement from --runs
RUNS_MAX = 200_000  # lines one --runs file may hold
RUNS_MAX_BYTES = 64 * 1024 * 1024


def _read_runs(
    path: Path, *, release: str, org: str, known: frozenset[str] | None
) -> list[admission.Checked]:
    """The submissions of a --runs JSONL file, every line checked (once) before anything
    is sent.

    One JSON object a line: ``play`` (required), ``params``, ``release`` (default
    --release), ``org`` (default --org), ``idempotency_key``, ``priority``. An unknown field
    is refused, never ignored. Blank lines are skipped.
    """
    subs: list[admission.Checked] = []
    size = 0
    try:
        fh = open(path, "rb")  # noqa: SIM115 (closed below; the stat check needs the handle)
    except OSError as exc:
        raise InvalidField(
            f"cannot read {path}: {exc.strerror or exc}",
            field="--runs",
            rule="a readable regular file",
            fix="check the path and its permissions",
        ) from exc
    with fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise InvalidField(
                f"{path} is not a regular file",
                field="--runs",
                rule="a regular JSONL file",
                fix="write the submissions to a file first",
            )
        for number, raw in enumerate(fh, start=1):
            size += len(raw)
            if size > RUNS_MAX_BYTES or len(subs) >= RUNS_MAX:
                raise InvalidField(
                    f"{path} holds more than {RUNS_MAX} submissions or {RUNS_MAX_BYTES} bytes",
                    field="--runs",
                    rule=f"at most {RUNS_MAX} lines and {RUNS_MAX_BYTES} bytes",
                    fix="split the file",
                )
            where = f"--runs line {number}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise InvalidField(
                    f"{where} is not UTF-8",
                    field="--runs",
                    rule="a UTF-8 JSONL file",
                    fix="re-save the file as UTF-8",
                ) from exc
            if not line:
                continue
            item = fields.decode(line, field="--runs", what=where)
            if not isinstance(item, dict) or "play" not in item:
                raise InvalidField(
                    f"{where} is not a JSON object with a play",
                    field="--runs",
                    rule='one object a line, such as {"play": "enrich", "params": {}}',
                    fix="fix that line",
                )
            unknown = sorted(set(item) - RUNS_FIELDS)
            if unknown:
                raise InvalidField(
                    f"{where} has unknown fields {', '.join(unknown)}",
                    field="--runs",
                    rule=f"only {', '.join(sorted(RUNS_FIELDS))}",
                    fix="remove them (a newer client's fields are refused, never ignored)",
                )
            sub = admission.Submission(
                play=item["play"],
                params=item.get("params") or {},
                release=lanes.validate_release(item.get("release", release), field=where),
                org=item.get("org", org),
                idempotency_key=item.get("idempotency_key"),
                priority=item.get("priority", 0),
            )
            try:
                checked = admission.check(sub, known)
                admission.encode_params(sub.params)
            except InputError as exc:  # the same error, naming the line
                raise type(exc)(
                    f"{where}: {exc.message}", field=exc.field, rule=exc.rule, fix=exc.fix
                ) from exc
            subs.append(checked)
    return subs


def _submit_runs(
    state: State,
    path: Path,
    *,
    release: str,
    org: str,
    known: frozenset[str] | None,
    as_json: bool,
) -> None:
    """``worker submit --runs FILE``: the file's runs in statements of RUNS_BATCH."""
    subs = _read_runs(path, release=release, org=org, known=known)
    only = config.admission_only()
    purpose = config.Purpose.ADMISSION if only else config.Purpose.WORKER

    async def go(conn: Conn) -> int:
        admitter = admission.Admitter(admission_only=only)
        admitted: list[admission.Admitted] = []
        for start in range(0, len(subs), RUNS_BATCH):
            batch = subs[start : start + RUNS_BATCH]
            admitted += await admitter.submit_many(conn, batch)  # checked as they were read
        if as_json:
            emit_json(
                {
                    "runs": [
                        {"run_id": str(a.run_id), "created": a.created, "lane": a.lane}
                        for a in admitted
                    ]
                }
            )
        else:
            created = sum(a.created for a in admitted)
            click.echo(
                f"admitted {created} runs ({len(admitted) - created} already admitted) "
                f"on lanes {', '.join(sorted({a.lane for a in admitted})) or '(none)'}"
            )
        return 0

    connected(state, go, purpose)


@click.command()
@click.argument("play_name", metavar="PLAY", required=False)
@click.option(
    "--runs",
    "runs_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Admit a batch instead of PLAY: a JSONL file, one object a line (play, params, "
    "release, org, idempotency_key, priority), 1,000 runs a statement, each idempotent.",
)
@click.option("--params", default=None, help="Params as a JSON object.")
@click.option(
    "--params-file",
    type=click.Path(path_type=Path),
    default=None,
    help="Read params from a JSON file.",
)
@click.option(
    "--input",
    "input_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Input rows: a .csv (with header) or .jsonl file, read as a stream.",
)
@release_option
@click.option("--org", default="default", show_default=True, help="Organisation of the run.")
@click.option(
    "--idempotency-key",
    default=None,
    help="Key that makes the submit idempotent: send a submit that exited 6 again with the "
    "same key (it admits one run however often it is sent).",
)
@click.option(
    "--app",
    "app",
    default=None,
    help="module:attribute of your play Registry, to refuse unknown plays before writing.",
)
@click.option("--wait", is_flag=True, help="Wait for the run to finish.")
@click.option(
    "--wait-timeout",
    type=Duration(),
    default=None,
    help="With --wait: give up waiting after DURATION (exit 4; the run goes on).",
)
@max_outage_option("With --wait, once admitted: ")
@run_flags_option
@json_option
@pass_state
def submit(
    state: State,
    play_name: str | None,
    runs_path: Path | None,
    params: str | None,
    params_file: Path | None,
    input_path: Path | None,
    release: str | None,
    org: str,
    idempotency_key: str | None,
    app: str | None,
    wait: bool,
    wait_timeout: float | None,
    max_outage: float,
    run_flags: RunFlags,
    as_json: bool,
) -> None:
    """Admit a run of PLAY (one atomic statement), or the runs of a --runs file.

    A submit that meets a lost database (a restart, a failover under way) exits 6
    (DATABASE_UNREACHABLE) and may or may not have been admitted: send it again with the
    same --idempotency-key (docs/how-to/high-availability.md)."""
    # What was given together: a time limit needs --wait, --runs takes no single run's flags.
    timeout_needs_wait(wait_timeout, wait, flag="--wait-timeout")
    if wait and run_flags.timeout is not None and wait_timeout is None:
        click.echo(
            "note: --timeout is the run's own timeout (it fails past it); to stop waiting "
            "after a while, use --wait-timeout",
            err=True,
        )
    named_app = app or os.environ.get("WORKER_APP")
    release = config.default_release() if release is None else release
    if runs_path is not None:
        _alone_with_runs(
            play_name, params, params_file, input_path, idempotency_key, wait, run_flags
        )
        _submit_runs(
            state,
            runs_path,
            release=lanes.validate_release(release, field="--release"),
            org=org,
            known=load_app(named_app).names() if named_app else None,
            as_json=as_json,
        )
        return
    if play_name is None:
        raise InvalidField(
            "no PLAY given",
            field="PLAY",
            rule="the name of a play, or --runs FILE",
            fix="worker submit PLAY [--params JSON], or worker submit --runs runs.jsonl",
        )

    # The submission, every field checked once by its rule (the flag named in a refusal).
    sub = run_flags.submission(
        play_name,
        params=_read_params(params, params_file),
        release=release,
        org=org,
        idempotency_key=idempotency_key,
    )
    # The plays are known here only when the app is named (--app or WORKER_APP); otherwise
    # the worker refuses an unknown play (without burning an attempt). Admission-only mode
    # loads it too: importing the app is how a serverless caller refuses a typo early.
    known = load_app(named_app).names() if named_app else None
    checked = admission.check(sub, known, names=FLAG_NAMES)
    # Every check of the input happens before anything is written; the rows are streamed.
    rows = inputs.read_pages(input_path) if input_path else None

    # Admission-only: the admission role, which can do nothing but admit. A local caller
    # prepares the lane lazily, which takes the worker role.
    only = config.admission_only()
    purpose = config.Purpose.ADMISSION if only else config.Purpose.WORKER

    async def go(conn: Conn) -> int:
        admitted = await admission.Admitter(admission_only=only).submit(conn, checked, inputs=rows)
        if not wait:
            _answer(admitted, as_json)
            return 0
        return await wait_result(
            state.url_for(config.Purpose.READ), admitted.run_id, wait_timeout, as_json, max_outage
        )

    connected(state, go, purpose)


def _alone_with_runs(
    play_name: str | None,
    params: str | None,
    params_file: Path | None,
    input_path: Path | None,
    idempotency_key: str | None,
    wait: bool,
    run_flags: RunFlags,
) -> None:
    """Refuse the flags of a single run next to --runs (its file's lines carry them)."""
    given = [
        flag
        for flag, value in (
            ("PLAY", play_name),
            ("--params", params),
            ("--params-file", params_file),
            ("--input", input_path),
            ("--idempotency-key", idempotency_key),
            ("--wait", wait or None),
        )
        if value is not None
    ] + run_flags.given()
    if given:
        raise InvalidField(
            f"--runs with {', '.join(given)}",
            field="--runs",
            rule="a --runs file carries each run's play, params and key",
            fix="put them in the file's lines, or submit one run without --runs",
        )


def _answer(admitted: admission.Admitted, as_json: bool) -> None:
    """What ``worker submit`` without --wait prints of the run it admitted."""
    if as_json:
        emit_json(
            {"run_id": str(admitted.run_id), "created": admitted.created, "lane": admitted.lane}
        )
    else:
        verb = "admitted" if admitted.created else "already admitted"
        click.echo(f"{verb} run {admitted.run_id} on lane {printable(admitted.lane)}")
