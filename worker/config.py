"""Where the process finds its database, release and mode, all from the environment.

- database: each process connects with the narrowest role it needs (its *purpose*,
  :class:`Purpose`): ``worker migrate`` as the owner (``WORKER_MIGRATE_DATABASE_URL``),
  admission-only submits as the admission role (``WORKER_ADMISSION_DATABASE_URL``), reads
  (observe, result, lists, metrics) as the reader (``WORKER_READER_DATABASE_URL``), and
  everything else as the worker role; each falls back to ``WORKER_DATABASE_URL``, then
  ``DATABASE_URL``. With none set, the embedded Postgres in ``WORKER_HOME`` (started on
  first use), where each purpose logs in as its own role, except in production: with
  ``WORKER_ENV=production`` (or ``staging``), or on a platform that names itself in the
  environment (:data:`PLATFORM_VARIABLES`), a missing URL is ``DATABASE_URL_MISSING``.
  ``WORKER_ENV=development`` (or ``test``) allows the embedded database anywhere.
- release: ``WORKER_RELEASE``, then common deploy-platform commit variables (shortened to
  12 characters), then ``dev``.
- admission-only mode: ``VERCEL`` set to any non-blank value (as the production check
  reads it), or ``WORKER_ADMISSION_ONLY`` set to a value other than ``0``/``false``/``no``/
  ``off``: submit issues nothing but the atomic transaction.
- secrets (:data:`SECRET_VARIABLES`: the database URLs and ``WORKER_TOKEN_SECRET``): each
  may be given as ``NAME_FILE``, the path of a file that holds the value (the container
  convention). A service (``worker start``, ``recover``, ``gateway``) that finds one in
  its environment re-executes itself without them (:func:`hand_off_secrets`), so the
  environment of the running process (``/proc/PID/environ``) holds no password and no
  secret; the values live in this module's memory (:func:`environment`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from queues.authority import check_secret
from queues.errors import (
    DatabaseUnreachable,
    DatabaseUrlInvalid,
    DatabaseUrlMissing,
    InvalidField,
    TokenSecretMissing,
)
from queues.roles import Role

URL_VARIABLES = ("WORKER_DATABASE_URL", "DATABASE_URL")


class Purpose(StrEnum):
    """What a process connects for, which decides its role (least privilege)."""

    MIGRATE = "migrate"  # the owner: DDL, the migration gate only
    WORKER = "worker"  # wq_worker: workers, recovery, operator actions, local submits
    ADMISSION = "admission"  # wq_admission: admission-only submits (wq_submit only)
    READ = "read"  # wq_reader: observe, result, lists, metrics


# The purpose's own variable comes first; every purpose falls back to URL_VARIABLES.
PURPOSE_VARIABLES: dict[Purpose, tuple[str, ...]] = {
    Purpose.MIGRATE: ("WORKER_MIGRATE_DATABASE_URL",),
    Purpose.WORKER: (),
    Purpose.ADMISSION: ("WORKER_ADMISSION_DATABASE_URL",),
    Purpose.READ: ("WORKER_READER_DATABASE_URL",),
}
# The embedded server's login role per purpose (None: its superuser, for migrate only).
EMBEDDED_ROLES: dict[Purpose, str | None] = {
    Purpose.MIGRATE: None,
    Purpose.WORKER: Role.WORKER.value,
    Purpose.ADMISSION: Role.ADMISSION.value,
    Purpose.READ: Role.READER.value,
}
RELEASE_VARIABLES = ("WORKER_RELEASE",)
# Platform commit variables, most specific first. A commit sha is shortened to 12 chars.
COMMIT_VARIABLES = (
    "VERCEL_GIT_COMMIT_SHA",
    "RENDER_GIT_COMMIT",
    "RAILWAY_GIT_COMMIT_SHA",
    "HEROKU_SLUG_COMMIT",
    "SOURCE_VERSION",
    "GITHUB_SHA",
    "GIT_COMMIT",
)


ENV_VARIABLE = "WORKER_ENV"
PRODUCTION_ENVS = ("production", "staging")
DEVELOPMENT_ENVS = ("development", "test")
# Variables a platform sets in every process it runs (never only at build time), and that
# a developer's machine or a CI runner does not have. Each names the platform for the error.
PLATFORM_VARIABLES = (
    ("DYNO", "Heroku"),
    ("RENDER", "Render"),
    ("RAILWAY_ENVIRONMENT_ID", "Railway"),
    ("RAILWAY_ENVIRONMENT", "Railway"),
    ("FLY_APP_NAME", "Fly.io"),
    ("KUBERNETES_SERVICE_HOST", "Kubernetes"),
    ("K_SERVICE", "Cloud Run"),
    ("ECS_CONTAINER_METADATA_URI_V4", "Amazon ECS"),
    ("ECS_CONTAINER_METADATA_URI", "Amazon ECS"),
    ("AWS_LAMBDA_FUNCTION_NAME", "AWS Lambda"),
    ("VERCEL", "Vercel"),
    ("WEBSITE_SITE_NAME", "Azure App Service"),
)


def production_reason(env: Mapping[str, str] | None = None) -> str | None:
    """Why this process must not fall back to the embedded database, or None when it may.

    ``WORKER_ENV`` decides when set (an unknown value is refused rather than guessed);
    otherwise the first platform variable found does.
    """
    env = os.environ if env is None else env
    declared = env.get(ENV_VARIABLE, "").strip().lower()
    if declared in PRODUCTION_ENVS:
        return f"{ENV_VARIABLE}={declared}"
    if declared in DEVELOPMENT_ENVS:
        return None
    if declared:
        raise InvalidField(
            f"{ENV_VARIABLE} is {env[ENV_VARIABLE]!r}",
            field=ENV_VARIABLE,
            rule=f"one of {', '.join((*PRODUCTION_ENVS, *DEVELOPMENT_ENVS))}",
            fix=f"set {ENV_VARIABLE}=production or {ENV_VARIABLE}=development",
        )
    for name, platform in PLATFORM_VARIABLES:
        if env.get(name):
            return f"{name} is set ({platform})"
    return None


POOL_MODE_VARIABLE = "WORKER_POOL_MODE"
LISTEN_URL_VARIABLE = "WORKER_LISTEN_URL"


class PoolMode(StrEnum):
    """What sits between this process and Postgres (PgBouncer's ``pool_mode`` names).

    ``session``: a direct connection or a session-mode pooler; every connection is a
    session. ``transaction``: a transaction-mode pooler (PgBouncer ``pool_mode =
    transaction``): a connection is a session for one transaction only, so nothing may
    rely on session state: no server-side prepared statements (psycopg's
    ``prepare_threshold=None``), no LISTEN (a worker LISTENs on ``WORKER_LISTEN_URL``, or
    polls), no session advisory lock (the migration gate needs a direct URL).
    """

    SESSION = "session"
    TRANSACTION = "transaction"


def pool_mode(env: Mapping[str, str] | None = None) -> PoolMode:
    """``WORKER_POOL_MODE`` (default ``session``); an unknown value is refused."""
    env = os.environ if env is None else env
    value = env.get(POOL_MODE_VARIABLE, "").strip().lower() or PoolMode.SESSION.value
    try:
        return PoolMode(value)
    except ValueError:
        raise InvalidField(
            f"{POOL_MODE_VARIABLE} is {env[POOL_MODE_VARIABLE]!r}",
            field=POOL_MODE_VARIABLE,
            rule="session (a direct connection or a session-mode pooler) or transaction "
            "(PgBouncer pool_mode = transaction); statement mode is not supported",
            fix=f"set {POOL_MODE_VARIABLE}=transaction behind PgBouncer in transaction mode, "
            "else unset it",
        ) from None


def listen_url(env: Mapping[str, str] | None = None) -> str | None:
    """``WORKER_LISTEN_URL``: where a worker LISTENs (a direct or session-mode URL)."""
    env = environment(env)
    value = env.get(LISTEN_URL_VARIABLE, "").strip()
    return validate_url(value, source=LISTEN_URL_VARIABLE) if value else None


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in {"", "0", "false", "no", "off"}


def admission_only(env: Mapping[str, str] | None = None) -> bool:
    """Whether submits are admission-only. ``VERCEL`` counts as the platform sets it and
    as the production check reads it (any non-blank value: ``VERCEL=0`` is still Vercel);
    the project's own ``WORKER_ADMISSION_ONLY`` is a switch (``0``, ``false``, ``no``,
    ``off`` turn it off)."""
    env = os.environ if env is None else env
    return bool(env.get("VERCEL", "").strip()) or _truthy(env.get("WORKER_ADMISSION_ONLY"))


def default_release(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    for name in RELEASE_VARIABLES:
        if env.get(name):
            return env[name].strip()
    for name in COMMIT_VARIABLES:
        if env.get(name):
            return env[name].strip()[:12]
    return "dev"


def configured_url(
    env: Mapping[str, str] | None = None, purpose: Purpose = Purpose.WORKER
) -> tuple[str, str] | None:
    """The configured URL for ``purpose`` and the variable it came from, or None."""
    env = environment(env)
    for name in (*PURPOSE_VARIABLES[purpose], *URL_VARIABLES):
        if env.get(name):
            return env[name], name
    return None


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def validate_url(url: str, *, source: str = "DATABASE_URL") -> str:
    """Refuse a malformed URL before anything connects with it (never echoing secrets)."""
    scheme = _SCHEME.match(url)
    if scheme and scheme.group(1).lower() not in {"postgresql", "postgres"}:
        raise DatabaseUrlInvalid(
            f"the database URL in {source} has scheme {scheme.group(1)!r}",
            field=source,
            rule="the scheme must be postgresql:// or postgres://",
            fix=f"correct {source}",
        )
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        # libpq's message quotes the input, password included: never echo it.
        raise DatabaseUrlInvalid(
            f"the database URL in {source} is not a valid URL or conninfo string",
            field=source,
            rule="a libpq URL or conninfo, e.g. postgresql://user@host:5432/dbname",
            fix=f"correct {source}, or unset it to use the embedded database",
        ) from exc
    return url


def resolve_url(
    explicit: str | None = None,
    *,
    home: Path | None = None,
    env: Mapping[str, str] | None = None,
    purpose: Purpose = Purpose.WORKER,
) -> str:
    """The database URL for this process and purpose, starting the embedded server if needed.

    The one place every command that needs a database gets it from: in production a
    missing URL is an error, never a silently started empty database.
    """
    env = environment(env)
    if explicit:
        return validate_url(explicit, source="--database-url")
    configured = configured_url(env, purpose)
    if configured:
        url, source = configured
        return validate_url(url, source=source)
    reason = production_reason(env)
    if reason is not None:
        raise DatabaseUrlMissing(
            f"no database URL is set, and this is production ({reason}): the embedded "
            "database would start empty",
            field="WORKER_DATABASE_URL",
            rule="production needs a database URL; the embedded database is for development",
            fix=f"set WORKER_DATABASE_URL or DATABASE_URL; set {ENV_VARIABLE}=development "
            "to allow the embedded database",
        )
    from worker import embedded

    return embedded.ensure_running(home).url(role=EMBEDDED_ROLES[purpose])


TOKEN_SECRET_VARIABLE = "WORKER_TOKEN_SECRET"


def token_secret(
    explicit: str | None = None,
    *,
    home: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> bytes:
    """The secret attempt tokens are signed and verified with: ``WORKER_TOKEN_SECRET`` (the
    same for every worker and gateway of a deployment), or, on the embedded database, one
    derived from its secret (kept with mode 0600)."""
    env = environment(env)
    value = env.get(TOKEN_SECRET_VARIABLE)
    if value:
        return check_secret(value)
    if uses_embedded(explicit, env) and production_reason(env) is None:
        from worker import embedded

        return embedded.ensure_running(home).derived_secret("tokens")
    raise TokenSecretMissing(
        "no secret to sign attempt tokens with",
        field=TOKEN_SECRET_VARIABLE,
        rule="a shared secret of at least 32 bytes, the same for every worker and gateway",
        fix=f"set {TOKEN_SECRET_VARIABLE} (e.g. `python -c 'import secrets; "
        "print(secrets.token_urlsafe(48))'`) in every worker and gateway",
    )


def scrub_worker_urls(env: dict[str, str] | None = None) -> list[str]:
    """Remove the worker's own database URLs and its token secret (``WORKER_*DATABASE_URL``,
    ``WORKER_LISTEN_URL``, ``WORKER_TOKEN_SECRET``) from ``os.environ`` once it has read
    them, so the subprocesses of its in-process plays do not inherit them; the names
    removed. DATABASE_URL is left alone: by convention it may be the app's own database.

    This changes what children inherit, not ``/proc/PID/environ`` of this process (the
    environment it was started with): that is :func:`hand_off_secrets`'s job."""
    target: Any = os.environ if env is None else env
    names = sorted(
        {
            "WORKER_DATABASE_URL",
            LISTEN_URL_VARIABLE,
            TOKEN_SECRET_VARIABLE,
            *(n for v in PURPOSE_VARIABLES.values() for n in v),
        }
    )
    removed = [name for name in names if target.pop(name, None) is not None]
    return removed


# ---- secrets: NAME_FILE, and no secret in a service's environment -----------------------

# The dashboard's login secret (worker.dashboard.auth reads it).
DASHBOARD_SECRET_VARIABLE = "WORKER_DASHBOARD_SECRET"
# The variables that hold a password or a secret (a password inside a URL counts).
SECRET_VARIABLES = (
    *URL_VARIABLES,
    *(n for v in PURPOSE_VARIABLES.values() for n in v),
    LISTEN_URL_VARIABLE,
    TOKEN_SECRET_VARIABLE,
    DASHBOARD_SECRET_VARIABLE,
)
FILE_SUFFIX = "_FILE"
HANDOFF_VARIABLE = "WORKER_SECRETS_FD"  # the re-executed process's pipe of secrets
HANDOFF_MAX_BYTES = 60_000  # under a pipe's buffer: written whole before the exec
_handed: dict[str, str] = {}  # the secrets a re-exec handed over
_files: set[str] = set()  # the NAME_FILE paths read (a sandbox never sees them)


def _receive() -> None:
    """Take the secrets a re-exec handed over (once: the pipe is read and closed)."""
    fd = os.environ.pop(HANDOFF_VARIABLE, None)
    if fd is not None and fd.isdigit():
        chunks = []
        try:
            while chunk := os.read(int(fd), 65536):
                chunks.append(chunk)
            os.close(int(fd))
        except OSError:
            chunks = []
        if chunks:
            handed = json.loads(b"".join(chunks))
            _handed.update({k: str(v) for k, v in handed.items() if k in SECRET_VARIABLES})


def _from_files() -> dict[str, str]:
    """The secrets given as NAME_FILE: each file's content, stripped."""
    found = {}
    for name in SECRET_VARIABLES:
        path = os.environ.get(name + FILE_SUFFIX)
        if not path:
            continue
        if os.environ.get(name):
            raise InvalidField(
                f"both {name} and {name}{FILE_SUFFIX} are set",
                field=name + FILE_SUFFIX,
                rule="one of them: the value, or the path of a file that holds it",
                fix=f"unset {name} (keep the secret in the file)",
            )
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise InvalidField(
                f"cannot read {name}{FILE_SUFFIX} ({path}): {exc.strerror}",
                field=name + FILE_SUFFIX,
                rule="the path of a readable file that holds the value",
                fix=f"correct {name}{FILE_SUFFIX}, or make the file readable by this user",
            ) from None
        if not value:
            raise InvalidField(
                f"{name}{FILE_SUFFIX} ({path}) is empty",
                field=name + FILE_SUFFIX,
                rule="a file that holds the value",
                fix=f"write the value of {name} into {path}",
            )
        found[name] = value
        _files.add(path)
    return found


def environment(env: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """``env``, or this process's environment with the secrets it holds in memory (from
    ``NAME_FILE`` files, or handed over by :func:`hand_off_secrets`) over it."""
    if env is not None:
        return env
    _receive()
    held = {**_handed, **_from_files()}
    return {**os.environ, **held} if held else os.environ


def credential_files() -> list[str]:
    """The ``NAME_FILE`` paths this process read its secrets from."""
    return sorted(_files)


def hand_off_secrets() -> None:
    """For a service, before it reads anything else: when a secret variable is in this
    process's environment, re-execute it (the same pid, argv and interpreter) without
    them, their values passed through an inherited pipe that the new process reads and
    closes at once (:func:`environment`). ``/proc/PID/environ`` shows the environment a
    process was started with, whatever it removes from ``os.environ`` later: only a new
    exec empties it. Returns only when there was nothing to hand off."""
    _receive()
    _from_files()  # a NAME_FILE that cannot be read is refused before the exec
    present = {name: os.environ[name] for name in SECRET_VARIABLES if os.environ.get(name)}
    if not present:
        return
    payload = json.dumps(present).encode()
    if len(payload) > HANDOFF_MAX_BYTES:
        raise InvalidField(
            f"the secret variables hold {len(payload)} bytes",
            field=", ".join(sorted(present)),
            rule=f"at most {HANDOFF_MAX_BYTES} bytes in all",
            fix="shorten them",
        )
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES}
    read, write = os.pipe()
    os.write(write, payload)
    os.close(write)
    os.set_inheritable(read, True)
    env[HANDOFF_VARIABLE] = str(read)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def uses_embedded(explicit: str | None, env: Mapping[str, str] | None = None) -> bool:
    """Whether this process's database is the embedded server (no URL anywhere)."""
    env = environment(env)
    names = {name for variables in PURPOSE_VARIABLES.values() for name in variables}
    return not explicit and not any(env.get(name) for name in (*names, *URL_VARIABLES))


_ROLE_LOGIN = re.compile(
    r'(role "(?P<a>wq_[a-z]+)" (does not exist|is not permitted to log in))'
    r'|(password authentication failed for user "(?P<b>wq_[a-z]+)")'
)


def unreachable(url: str, exc: BaseException) -> DatabaseUnreachable:
    safe = redact(url)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    role = _ROLE_LOGIN.search(str(exc))
    if role is not None:
        # One of the project's roles cannot log in yet: the migration gate makes them.
        name = role["a"] or role["b"]
        return DatabaseUnreachable(
            f"cannot connect to the database at {safe} as {name}: {first}",
            field="role",
            rule=f"{name} is created (and, on the embedded server, allowed to log in) by "
            "`worker migrate`",
            fix="run `worker migrate` first; on your own Postgres, grant the role to the "
            "login user of this URL (docs/deploy.md)",
        )
    return DatabaseUnreachable(
        f"cannot connect to the database at {safe}: {first}",
        fix="start Postgres or correct DATABASE_URL (unset it to use the embedded database)",
    )


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "<malformed url>"
    host = str(parts.get("host") or "localhost")
    port = str(parts.get("port") or "5432")
    user = str(parts.get("user") or "")
    dbname = str(parts.get("dbname") or "")
    return f"postgresql://{user + '@' if user else ''}{host}:{port}/{dbname}"
