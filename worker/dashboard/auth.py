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
  the secret logs everybody out. The token names a session the server keeps (its id, in
  this process's memory): a token whose session the server does not hold is refused,
  however well signed, so logging out ends it at once, and so does a restart of the
  dashboard (several dashboards behind one address need sticky sessions).
- **Login throttling** (:class:`LoginThrottle`): each login attempt takes a token from its
  client's bucket and from one bucket for all clients; an empty bucket answers 429 with
  ``Retry-After``. A login that succeeds gives its token back, so only wrong ones count.
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import jwt
from starlette.requests import Request

from queues.errors import InvalidField
from worker import config

SECRET_VARIABLE = config.DASHBOARD_SECRET_VARIABLE
SECRET_FILE = "dashboard-secret"
MIN_SECRET = 16
SESSION_COOKIE = "wq_session"
LOGIN_COOKIE = "wq_login"
SESSION_TTL_S = 12 * 3600
MAX_SESSIONS = 10_000  # sessions held at once; past it the oldest ends
# Login attempts: a client may make LOGIN_BURST at once, then one per LOGIN_REFILL_S; all
# clients together LOGIN_BURST_ALL, then one per LOGIN_REFILL_ALL_S.
LOGIN_BURST = 5
LOGIN_REFILL_S = 12.0
LOGIN_BURST_ALL = 30
LOGIN_REFILL_ALL_S = 1.0
MAX_TRACKED_CLIENTS = 10_000
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}$")


def resolve_secret(
    *, home: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """The login secret and where it came from (the variable, or the file's path)."""
    env = config.environment(env)  # the variable, its _FILE, or what a re-exec handed over
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
    id: str = ""  # the server's name for it (revoked by logout)

    @property
    def actor(self) -> str:
        return f"dashboard:{self.user}"


class Sessions:
    """Signs and reads session cookies with a key derived from the login secret, and holds
    the sessions that are live: a cookie counts only while its session is held."""

    def __init__(
        self, secret: str, *, ttl_s: float = SESSION_TTL_S, max_live: int = MAX_SESSIONS
    ) -> None:
        self._digest = hashlib.sha256(secret.encode()).digest()
        self._key = hmac.new(self._digest, b"wq-dashboard-session", hashlib.sha256).digest()
        self.ttl_s = ttl_s
        self.max_live = max_live
        self._live: dict[str, float] = {}  # session id -> expires at (epoch s), oldest first

    def secret_matches(self, given: str) -> bool:
        """Constant-time comparison of a login attempt with the secret."""
        return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), self._digest)

    def issue(self, user: str, *, now: float | None = None) -> tuple[str, Session]:
        now = time.time() if now is None else now
        session = Session(
            user=user,
            csrf=secrets.token_urlsafe(32),
            expires_at=now + self.ttl_s,
            id=secrets.token_urlsafe(18),
        )
        token = jwt.encode(
            {
                "sub": user,
                "sid": session.id,
                "csrf": session.csrf,
                "iat": int(now),
                "exp": int(session.expires_at),
            },
            self._key,
            algorithm="HS256",
        )
        self._hold(session, now)
        return token, session

    def _hold(self, session: Session, now: float) -> None:
        for sid in [sid for sid, ends in self._live.items() if ends <= now]:
            del self._live[sid]
        while len(self._live) >= self.max_live:
            del self._live[next(iter(self._live))]  # the oldest
        self._live[session.id] = session.expires_at

    def read(self, token: str | None, *, now: float | None = None) -> Session | None:
        """The session of a cookie: signed with our key, unexpired, and still held."""
        if not token:
            return None
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=["HS256"],
                options={"require": ["exp", "sub", "sid"]},
            )
        except jwt.PyJWTError:
            return None
        user, csrf, sid = claims.get("sub"), claims.get("csrf"), claims.get("sid")
        if not isinstance(user, str) or not isinstance(csrf, str) or not isinstance(sid, str):
            return None
        now = time.time() if now is None else now
        if self._live.get(sid, 0.0) <= now:
            return None  # logged out, ended by a restart, or evicted
        return Session(user=user, csrf=csrf, expires_at=float(claims["exp"]), id=sid)

    def revoke(self, session: Session) -> None:
        """End ``session``: its cookie is refused from now on (logout)."""
        self._live.pop(session.id, None)

    @property
    def live(self) -> int:
        return len(self._live)


class LoginThrottle:
    """Token buckets of login attempts: one per client and one for all clients.

    :meth:`take` takes a token from both (an attempt in flight counts at once, so parallel
    attempts cannot all pass) or says how long to wait; :meth:`give_back` returns it for a
    login that succeeded."""

    def __init__(
        self,
        *,
        burst: int = LOGIN_BURST,
        refill_s: float = LOGIN_REFILL_S,
        burst_all: int = LOGIN_BURST_ALL,
        refill_all_s: float = LOGIN_REFILL_ALL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.refill_s = burst, refill_s
        self.burst_all, self.refill_all_s = burst_all, refill_all_s
        self.clock = clock
        self._clients: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)
        self._all: tuple[float, float] = (float(burst_all), clock())

    @staticmethod
    def _level(bucket: tuple[float, float], burst: int, refill_s: float, now: float) -> float:
        tokens, at = bucket
        return min(float(burst), tokens + (now - at) / refill_s)

    def take(self, client: str) -> float | None:
        """None when the attempt may go on (a token taken from each bucket), else the
        seconds until it may."""
        now = self.clock()
        mine = self._level(
            self._clients.get(client, (float(self.burst), now)), self.burst, self.refill_s, now
        )
        everyone = self._level(self._all, self.burst_all, self.refill_all_s, now)
        if mine < 1 or everyone < 1:
            return max((1 - mine) * self.refill_s, (1 - everyone) * self.refill_all_s, 0.0)
        self._forget_full(now)
        self._clients[client] = (mine - 1, now)
        self._all = (everyone - 1, now)
        return None

    def give_back(self, client: str) -> None:
        now = self.clock()
        if client in self._clients:
            mine = self._level(self._clients[client], self.burst, self.refill_s, now)
            self._clients[client] = (min(float(self.burst), mine + 1), now)
        everyone = self._level(self._all, self.burst_all, self.refill_all_s, now)
        self._all = (min(float(self.burst_all), everyone + 1), now)

    def _forget_full(self, now: float) -> None:
        """Bounded memory: clients whose bucket is full again are forgotten, and past
        :data:`MAX_TRACKED_CLIENTS` the oldest are."""
        if len(self._clients) < MAX_TRACKED_CLIENTS:
            return
        for client, bucket in list(self._clients.items()):
            if self._level(bucket, self.burst, self.refill_s, now) >= self.burst:
                del self._clients[client]
        while len(self._clients) >= MAX_TRACKED_CLIENTS:
            del self._clients[next(iter(self._clients))]


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
