"""The dashboard's login secret, sessions and cross-site request protection.

- **The secret**: ``WORKER_DASHBOARD_SECRET`` (at least 16 characters; the same for every
  dashboard of a deployment), or on a development machine one generated on first use and
  kept in ``$WORKER_HOME/dashboard-secret`` (mode 0600, next to the embedded database's
  secret; refused if another user owns it or others may read it). Production without the
  variable is an error, never a generated secret nobody knows.
- **Sessions**: logging in takes a name (recorded with every action as
  ``dashboard:<name>``) and the secret; the session is a signed, expiring token (JWT,
  HS256, with PyJWT, as attempt tokens are) in an ``HttpOnly``, ``SameSite=Strict``
  cookie (``Secure`` behind https), signed with a key derived from the secret: changing
  the secret logs everybody out.
- **Cross-site requests**: every POST must come from the dashboard's own origin (its
  ``Origin``, else its ``Referer``, names this host) and carry the session's CSRF token
  (a random value in the session, echoed by each form). The login form, which has no
  session yet, uses a double-submit cookie instead.

The name is who the operator says they are: everyone who knows the secret can act, and the
audit trail is as good as the names they give (a per-user identity belongs to a proxy in
front, e.g. an SSO gateway).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import jwt
from starlette.requests import Request

from queues.errors import InvalidField
from worker import config

SECRET_VARIABLE = "WORKER_DASHBOARD_SECRET"
SECRET_FILE = "dashboard-secret"
MIN_SECRET = 16
SESSION_COOKIE = "wq_session"
LOGIN_COOKIE = "wq_login"
SESSION_TTL_S = 12 * 3600
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}$")


def resolve_secret(
    *, home: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """The login secret and where it came from (the variable, or the file's path)."""
    env = os.environ if env is None else env
    value = env.get(SECRET_VARIABLE, "")
    if value:
        if len(value.strip()) < MIN_SECRET:
            raise InvalidField(
                f"{SECRET_VARIABLE} is shorter than {MIN_SECRET} characters",
                field=SECRET_VARIABLE,
                rule=f"a secret of at least {MIN_SECRET} characters",
                fix="generate one: python -c 'import secrets; print(secrets.token_urlsafe(24))'",
            )
        return value.strip(), SECRET_VARIABLE
    reason = config.production_reason(env)
    if reason is not None:
        raise InvalidField(
            f"no dashboard login secret, and this is production ({reason})",
            field=SECRET_VARIABLE,
            rule="production sets the dashboard's login secret; only a development machine "
            "generates one",
            fix=f"set {SECRET_VARIABLE} to a secret of at least {MIN_SECRET} characters",
        )
    from worker import embedded

    folder = (home or embedded.default_home()).absolute()
    path = folder / SECRET_FILE
    return _read_or_create(path), str(path)


def _read_or_create(path: Path) -> str:
    found = _read(path)
    if found:
        return found
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), 0o600)
            fh.write(secrets.token_urlsafe(24) + "\n")
        with contextlib.suppress(FileExistsError):  # a concurrent first start won: read it
            os.link(tmp, path)
    finally:
        tmp.unlink()
    found = _read(path)
    assert found, f"{path} was just written"
    return found


def _read(path: Path) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            info, text = os.fstat(fh.fileno()), fh.read()
    except FileNotFoundError:
        return None
    if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise InvalidField(
            f"the dashboard secret {path} is not private (owner uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):04o})",
            field=SECRET_VARIABLE,
            rule="a file of yours that nobody else can read (mode 0600)",
            fix=f"chmod 600 {path} if nobody else read it; otherwise delete it so a new one "
            f"is made, or set {SECRET_VARIABLE}",
        )
    return text.strip() or None


def check_name(name: str) -> str | None:
    """The operator's name as given at login, or None when it is not a short name."""
    name = name.strip()
    return name if _NAME.fullmatch(name) else None


@dataclass(frozen=True, slots=True)
class Session:
    user: str
    csrf: str
    expires_at: float

    @property
    def actor(self) -> str:
        return f"dashboard:{self.user}"


class Sessions:
    """Signs and reads session cookies with a key derived from the login secret."""

    def __init__(self, secret: str, *, ttl_s: float = SESSION_TTL_S) -> None:
        self._digest = hashlib.sha256(secret.encode()).digest()
        self._key = hmac.new(self._digest, b"wq-dashboard-session", hashlib.sha256).digest()
        self.ttl_s = ttl_s

    def secret_matches(self, given: str) -> bool:
        """Constant-time comparison of a login attempt with the secret."""
        return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), self._digest)

    def issue(self, user: str, *, now: float | None = None) -> tuple[str, Session]:
        now = time.time() if now is None else now
        session = Session(user=user, csrf=secrets.token_urlsafe(32), expires_at=now + self.ttl_s)
        token = jwt.encode(
            {"sub": user, "csrf": session.csrf, "iat": int(now), "exp": int(session.expires_at)},
            self._key,
            algorithm="HS256",
        )
        return token, session

    def read(self, token: str | None) -> Session | None:
        if not token:
            return None
        try:
            claims = jwt.decode(
                token, self._key, algorithms=["HS256"], options={"require": ["exp", "sub"]}
            )
        except jwt.PyJWTError:
            return None
        user, csrf = claims.get("sub"), claims.get("csrf")
        if not isinstance(user, str) or not isinstance(csrf, str):
            return None
        return Session(user=user, csrf=csrf, expires_at=float(claims["exp"]))


def same_origin(request: Request) -> bool:
    """Whether a POST comes from a page of this dashboard: its Origin (or, without one,
    its Referer) names this scheme and host. Neither header: refused."""
    host = request.headers.get("host", "")
    expected = f"{request.url.scheme}://{host}"
    origin = request.headers.get("origin")
    if origin is not None:
        return origin != "null" and hmac.compare_digest(origin.rstrip("/"), expected)
    referer = request.headers.get("referer")
    if referer:
        parts = urlsplit(referer)
        return hmac.compare_digest(f"{parts.scheme}://{parts.netloc}", expected)
    return False


def token_matches(expected: str, given: object) -> bool:
    return isinstance(given, str) and bool(given) and hmac.compare_digest(expected, given)


def safe_next(target: str | None) -> str:
    """A local path to go to after login (never another site: no scheme, no //host)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/runs"
    return target
