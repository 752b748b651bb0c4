"""Where the process finds its database, release and mode, all from the environment.

- database: ``WORKER_DATABASE_URL``, then ``DATABASE_URL``; with neither, the embedded
  Postgres in ``WORKER_HOME`` (started on first use).
- release: ``WORKER_RELEASE``, then common deploy-platform commit variables (shortened to
  12 characters), then ``dev``.
- admission-only mode: ``WORKER_ADMISSION_ONLY`` or ``VERCEL`` set to a non-empty value
  other than ``0``/``false``: submit issues nothing but the atomic transaction.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

from queues.errors import DatabaseUnreachable, DatabaseUrlInvalid

URL_VARIABLES = ("WORKER_DATABASE_URL", "DATABASE_URL")
ADMISSION_ONLY_VARIABLES = ("WORKER_ADMISSION_ONLY", "VERCEL")
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


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in {"", "0", "false", "no", "off"}


def admission_only(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return any(_truthy(env.get(name)) for name in ADMISSION_ONLY_VARIABLES)


def default_release(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    for name in RELEASE_VARIABLES:
        if env.get(name):
            return env[name].strip()
    for name in COMMIT_VARIABLES:
        if env.get(name):
            return env[name].strip()[:12]
    return "dev"


def configured_url(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    for name in URL_VARIABLES:
        if env.get(name):
            return env[name]
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


def resolve_url(explicit: str | None = None, *, home: Path | None = None) -> str:
    """The database URL for this process, starting the embedded server if needed."""
    if explicit:
        return validate_url(explicit, source="--database-url")
    url = configured_url()
    if url:
        source = next(name for name in URL_VARIABLES if os.environ.get(name))
        return validate_url(url, source=source)
    from worker import embedded

    return embedded.ensure_running(home).url()


def unreachable(url: str, exc: BaseException) -> DatabaseUnreachable:
    safe = redact(url)
    return DatabaseUnreachable(
        f"cannot connect to the database at {safe}: {str(exc).strip().splitlines()[0]}",
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
