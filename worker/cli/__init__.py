"""The ``worker`` command line: thin commands over ``queues`` and the runtime.

One convention for every command: data goes to stdout (text, or JSON with ``--json``, with
ISO 8601 timestamps), messages and logs to stderr; durations are ``500ms``/``60s``/``5m``/
``1h``/``7d``; interactive commands are quiet unless ``-v`` is given, services log at INFO.
Every failure ends at one boundary (:func:`main`) as ``error[CODE]: message (field: rule)
Fix: ...`` with the exit status of :class:`queues.errors.ExitCode`, never a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import MutableMapping
from pathlib import Path

import click
import psycopg

from queues.errors import ExitCode, WorkerError, connection_lost, translate
from worker import config, logs
from worker.cli.common import State, report
from worker.output import printable

# Services: they log at INFO unless told otherwise; every other command logs warnings only.
SERVICES = frozenset({"start", "recover", "gateway", "dashboard"})
# The commands that re-execute themselves without the secrets in their environment
# (worker.config.hand_off_secrets): they do it before their module is imported, so the
# process that is replaced has loaded only this package.
HAND_OFF = frozenset({"start", "recover", "gateway"})


# Each command and the module that defines it, imported only when that command runs (or
# when help lists them all): ``worker submit`` from a serverless function loads admission,
# never the runtime, the dashboard or the embedded server's tooling.
COMMANDS: dict[str, str] = {
    "migrate": "admin:migrate",
    "db": "admin:db_group",
    "metrics": "admin:metrics",
    "demo": "admin:demo",
    "start": "processes:start",
    "recover": "processes:recover_command",
    "gateway": "processes:gateway_command",
    "submit": "submit:submit",
    "result": "runs:result",
    "observe": "runs:observe_cmd",
    "cancel": "runs:cancel",
    "emit": "runs:emit",
    "runs": "runs:runs_group",
    "events": "ledger:events_command",
    "sinks": "ledger:sinks_group",
    "queues": "lanes:queues_group",
    "token": "tokens:token_group",
    "limits": "scheduling:limits_group",
    "schedules": "scheduling:schedules_group",
    "costs": "costs:costs_command",
    "budgets": "costs:budgets_group",
    "dashboard": "ops:dashboard_command",
}


class LazyGroup(click.Group):
    """A group whose commands are looked up in :data:`COMMANDS` when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | COMMANDS.keys())

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self._load(cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] in HAND_OFF and not ctx.resilient_parsing:
            config.hand_off_secrets()  # returns only when there was nothing to hand off
        return super().resolve_command(ctx, args)

    def loaded(self) -> MutableMapping[str, click.Command]:
        """Every command, imported: ``commands`` is complete from then on (the reference
        docs and the tests that walk the tree read it)."""
        for name in COMMANDS:
            self._load(name)
        return self.commands

    def _load(self, name: str) -> None:
        if name in self.commands or name not in COMMANDS:
            return
        module, _, attr = COMMANDS[name].partition(":")
        command = getattr(importlib.import_module(f"worker.cli.{module}"), attr)
        if command.name != name:
            raise RuntimeError(f"COMMANDS names {name!r} for the command {command.name!r}")
        self.add_command(command)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--version``, looked up only when asked."""
    if not value or ctx.resilient_parsing:
        return
    from queues import migrations

    click.echo(f"worker {migrations.code_release()}")
    ctx.exit()


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)
@click.option(
    "--database-url",
    help="Postgres URL (default: $WORKER_DATABASE_URL, then $DATABASE_URL, else the embedded "
    "database; per-role variables in docs/reference/settings.md).",
)
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="WORKER_HOME",
    help="Directory of the embedded database (default: $WORKER_HOME or a per-user dir).",
)
@click.option("-v", "--verbose", count=True, help="Log more: -v info, -vv debug.")
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default=None,
    help="Minimum level of log lines (default: INFO for services, WARNING otherwise).",
)
@click.option("--json-logs/--console-logs", default=None, help="Force the log format.")
@click.pass_context
def cli(
    ctx: click.Context,
    database_url: str | None,
    home: Path | None,
    verbose: int,
    log_level: str | None,
    json_logs: bool | None,
) -> None:
    """A durable, release-pinned task-queue worker on Postgres."""
    if log_level is None:
        if verbose >= 2:
            log_level = "DEBUG"
        elif verbose == 1 or ctx.invoked_subcommand in SERVICES:
            log_level = "INFO"
        else:
            log_level = "WARNING"
    logs.configure(level=log_level, json=json_logs)
    ctx.obj = State(database_url, home)


def main(argv: list[str] | None = None) -> None:
    """The console script: run the command, and end every failure at this boundary."""
    try:
        cli.main(args=argv, prog_name="worker", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("interrupted", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    except click.ClickException as exc:
        click.echo(f"error[USAGE_INVALID]: {printable(exc.format_message(), lines=True)}", err=True)
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            click.echo(f"See `{exc.ctx.command_path} --help`.", err=True)
        sys.exit(ExitCode.BAD_INPUT)
    except WorkerError as exc:
        report(exc)
        sys.exit(exc.exit_code)
    except psycopg.Error as exc:
        # A database error is reported, never a traceback: ours by its code, a lost
        # connection as unreachable, anything else as the database's own message.
        mapped = translate(exc)
        if mapped is not None:
            report(mapped)
            sys.exit(mapped.exit_code)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        state = f" (SQLSTATE {exc.sqlstate})" if exc.sqlstate else ""
        click.echo(f"error[DATABASE_ERROR]: {printable(first)}{state}", err=True)
        sys.exit(ExitCode.DATABASE_UNREACHABLE if connection_lost(exc) else ExitCode.FAILED)
    except OSError as exc:
        shown = printable(exc.strerror or exc)
        click.echo(f"error[OS_ERROR]: {shown} ({type(exc).__name__})", err=True)
        sys.exit(ExitCode.FAILED)
    except Exception as exc:
        # A bug: say so in one line, and show the traceback only when asked to.
        click.echo(
            f"error[INTERNAL_ERROR]: {type(exc).__name__}: {printable(exc)} Fix: this is a "
            "bug; rerun with WORKER_DEBUG=1 for the traceback and report it",
            err=True,
        )
        if os.environ.get("WORKER_DEBUG"):
            traceback.print_exc()
        sys.exit(ExitCode.FAILED)


__all__ = ["State", "cli", "main"]
