"""The dashboard's Starlette app: server-rendered pages, live by polling, guarded actions.

Pages (GET, the reader role's pool): ``/runs`` (filters and search), ``/runs/{id}``,
``/lanes``, ``/stats``. Actions (POST, each on a fresh connection of the worker role, the
narrowest that may act, each recorded with ``dashboard:<name>``): cancel and retry a run;
a lane's policy, drain and reclaim. Every page and action needs a session
(:mod:`worker.dashboard.auth`); every POST must be same-origin and carry the session's CSRF
token. Pages refresh their live parts by fetching themselves every few seconds
(``static/app.js``); they work without JavaScript, only not live.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

import jinja2
import psycopg
import structlog
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from queues import costs, dashboard, fields, operator, outcomes, policy
from queues.errors import InvalidField, RunNotFound, WorkerError, translate
from worker import db
from worker.dashboard import auth, charts
from worker.output import amount

log = structlog.get_logger("worker.dashboard")

HERE = Path(__file__).parent
MAX_FORM_BYTES = 64 * 1024
SINCE_CHOICES = ("15m", "1h", "6h", "24h", "7d", "30d")
LIVE_INTERVAL_MS = 2000
FAILED_LOGIN_DELAY_S = 0.5

SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        b"frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


class _SecurityHeaders:
    """Adds the security headers to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, sending)


# ---- template helpers ----------------------------------------------------------------------


def _ago(value: datetime | None) -> str:
    if value is None:
        return "-"
    seconds = (datetime.now(UTC) - value).total_seconds()
    if seconds < 0:
        return "in " + _duration(-seconds)
    return _duration(seconds) + " ago"


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m {int(seconds % 60)}s"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h {int(seconds % 3600 // 60)}m"
    return f"{int(seconds // 86400)}d {int(seconds % 86400 // 3600)}h"


def _iso(value: datetime | None) -> str:
    return value.astimezone(UTC).isoformat(timespec="seconds") if value else "-"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def _compact(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 300 else text[:297] + "..."


def make_templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(HERE / "templates")),
        autoescape=jinja2.select_autoescape(["html"]),
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(
        ago=_ago,
        duration=_duration,
        iso=_iso,
        pretty=_pretty,
        compact=_compact,
        human=fields.human_duration,
        amount=amount,
    )
    env.globals.update(
        live_interval_ms=LIVE_INTERVAL_MS,
        run_states=[s.value for s in outcomes.RunState],
        bar=charts.bar,
    )
    return Jinja2Templates(env=env)


# ---- the app ---------------------------------------------------------------------------------


Conn = psycopg.AsyncConnection[Any]


class Dashboard:
    """The app's state: the reader's pool, how actions connect, sessions, templates."""

    def __init__(
        self,
        *,
        reader: AsyncConnectionPool[Any],
        worker_url: str,
        sessions: auth.Sessions,
        throttle: auth.LoginThrottle | None = None,
    ) -> None:
        self.reader = reader
        self.worker_url = worker_url
        self.sessions = sessions
        self.throttle = throttle or auth.LoginThrottle()
        self.templates = make_templates()

    @contextlib.asynccontextmanager
    async def acting(self) -> AsyncIterator[Conn]:
        """A connection of the worker role for one action (operators act rarely)."""
        async with db.session(self.worker_url) as conn:
            yield conn

    def render(
        self, request: Request, name: str, context: dict[str, Any], status_code: int = 200
    ) -> Response:
        session: auth.Session | None = request.scope.get("wq_session")
        base = {
            "user": session.user if session else None,
            "csrf": session.csrf if session else "",
            "notice": request.query_params.get("notice"),
            "error": request.query_params.get("error"),
            "path": request.url.path,
        }
        return self.templates.TemplateResponse(
            request, name, base | context, status_code=status_code
        )


Handler = Callable[[Request], Awaitable[Response]]
Form = dict[str, str]
ActionHandler = Callable[[Request, Form, auth.Session], Awaitable[Response]]


async def _form(request: Request) -> dict[str, str]:
    """The urlencoded form of a POST (first value of each field), bounded in size."""
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise InvalidField(
            "the form is too large",
            field="form",
            rule=f"at most {MAX_FORM_BYTES} bytes",
            fix="send less",
        )
    parsed = parse_qs(body.decode("utf-8", errors="replace"), keep_blank_values=True)
    return {key: values[0] for key, values in parsed.items()}


def _back(path: str, **query: str) -> RedirectResponse:
    shown = {k: v[:500] for k, v in query.items() if v}
    return RedirectResponse(path + (f"?{urlencode(shown)}" if shown else ""), status_code=303)


def make_app(dash: Dashboard) -> Starlette:
    def page(handler: Handler) -> Handler:
        """A page: needs a session (else the login page, then back here)."""

        async def guarded(request: Request) -> Response:
            session = dash.sessions.read(request.cookies.get(auth.SESSION_COOKIE))
            if session is None:
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                return RedirectResponse("/login?" + urlencode({"next": target}), status_code=303)
            request.scope["wq_session"] = session
            try:
                return await handler(request)
            except (psycopg.OperationalError, PoolTimeout) as exc:
                log.warning("dashboard_database_unavailable", error=str(exc).strip()[:300])
                return dash.render(
                    request,
                    "error.html",
                    {
                        "title": "Database unavailable",
                        "message": "The database did not answer; this page retries by itself.",
                    },
                    status_code=503,
                )

        return guarded

    def action(handler: ActionHandler) -> Handler:
        """An action: a session, a same-origin request and the session's CSRF token."""

        async def guarded(request: Request) -> Response:
            session = dash.sessions.read(request.cookies.get(auth.SESSION_COOKIE))
            if session is None:
                return PlainTextResponse("log in first", status_code=403)
            if not auth.same_origin(request):
                log.warning(
                    "dashboard_cross_site_refused",
                    path=request.url.path,
                    origin=request.headers.get("origin"),
                )
                return PlainTextResponse("cross-site request refused", status_code=403)
            try:
                form = await _form(request)
            except WorkerError as exc:
                return PlainTextResponse(exc.render(), status_code=400)
            if not auth.token_matches(session.csrf, form.get("csrf")):
                log.warning("dashboard_csrf_refused", path=request.url.path, user=session.user)
                return PlainTextResponse("missing or wrong CSRF token", status_code=403)
            request.scope["wq_session"] = session
            return await handler(request, form, session)

        return guarded

    # ---- login -------------------------------------------------------------------------------

    async def login_page(request: Request) -> Response:
        token = request.cookies.get(auth.LOGIN_COOKIE) or uuid.uuid4().hex
        response = dash.render(
            request,
            "login.html",
            {
                "next": auth.safe_next(request.query_params.get("next")),
                "login_csrf": token,
                "failed": request.query_params.get("failed") == "1",
            },
        )
        response.set_cookie(
            auth.LOGIN_COOKIE,
            token,
            max_age=3600,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def login(request: Request) -> Response:
        if not auth.same_origin(request):
            return PlainTextResponse("cross-site request refused", status_code=403)
        form = await _form(request)
        expected = request.cookies.get(auth.LOGIN_COOKIE) or ""
        if not expected or not auth.token_matches(expected, form.get("login_csrf")):
            return PlainTextResponse(
                "missing or wrong login token: reload the page", status_code=403
            )
        target = auth.safe_next(form.get("next"))
        client = request.client.host if request.client else "unknown"
        wait_s = dash.throttle.take(client)
        if wait_s is not None:
            log.warning("dashboard_login_throttled", client=client, retry_after_s=wait_s)
            return PlainTextResponse(
                "too many login attempts: wait and try again",
                status_code=429,
                headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
            )
        name = auth.check_name(form.get("name", ""))
        if name is None or not dash.sessions.secret_matches(form.get("secret", "")):
            await asyncio.sleep(FAILED_LOGIN_DELAY_S)  # slows guessing
            log.warning("dashboard_login_failed", name=(form.get("name") or "")[:64], client=client)
            return _back("/login", next=target, failed="1")
        dash.throttle.give_back(client)  # only wrong logins use up the buckets
        cookie, _session = dash.sessions.issue(name)
        log.info("dashboard_login", user=name, client=client)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            auth.SESSION_COOKIE,
            cookie,
            max_age=int(dash.sessions.ttl_s),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        response.delete_cookie(auth.LOGIN_COOKIE)
        return response

    async def logout(request: Request, form: Form, session: auth.Session) -> Response:
        dash.sessions.revoke(session)  # the cookie is refused from now on, wherever it is
        log.info("dashboard_logout", user=session.user)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(auth.SESSION_COOKIE)
        return response

    # ---- runs --------------------------------------------------------------------------------

    async def runs_page(request: Request) -> Response:
        params = request.query_params
        problems: list[str] = []
        state = params.get("state") or None
        if state is not None and state not in outcomes.RunState.__members__.values():
            problems.append(f"unknown state {state!r}")
            state = None
        since_text = params.get("since") or None
        since = None
        if since_text:
            try:
                since = datetime.now(UTC) - timedelta(
                    seconds=fields.duration(since_text, field="since")
                )
            except InvalidField as exc:
                problems.append(exc.render())
        f = dashboard.RunFilter(
            state=state,
            play=(params.get("play") or "").strip()[:100] or None,
            release=(params.get("release") or "").strip()[:100] or None,
            org=(params.get("org") or "").strip()[:100] or None,
            since=since,
            search=(params.get("q") or "").strip()[:200] or None,
        )
        async with dash.reader.connection() as conn:
            found = await dashboard.list_runs(conn, f)
            releases = await dashboard.releases(conn)
        return dash.render(
            request,
            "runs.html",
            {
                "runs": found,
                "filter": f,
                "since": since_text or "",
                "releases": releases,
                "since_choices": SINCE_CHOICES,
                "problems": problems,
                "limit": f.limit,
            },
        )

    async def run_page(request: Request) -> Response:
        try:
            run_id = uuid.UUID(request.path_params["run_id"])
        except ValueError:
            return dash.render(
                request,
                "error.html",
                {"title": "Not a run id", "message": "That is not a run id."},
                status_code=404,
            )
        try:
            async with dash.reader.connection() as conn:
                detail = await dashboard.run_detail(conn, run_id)
        except RunNotFound:
            return dash.render(
                request,
                "error.html",
                {"title": "No such run", "message": f"There is no run {run_id}."},
                status_code=404,
            )
        return dash.render(request, "run.html", {"d": detail, "run": detail.run})

    async def run_cancel(request: Request, form: Form, session: auth.Session) -> Response:
        run_id = request.path_params["run_id"]
        path = f"/runs/{run_id}"
        try:
            rid = uuid.UUID(run_id)
            async with dash.acting() as conn:
                done = await operator.cancel(
                    conn,
                    rid,
                    actor=session.actor,
                    reason=form.get("reason") or None,
                    force=form.get("force") == "1",
                )
        except (WorkerError, ValueError) as exc:
            return _back(path, error=_message(exc))
        except psycopg.Error as exc:
            return _back(path, error=_database(exc))
        log.info(
            "dashboard_cancel",
            run_id=run_id,
            user=session.user,
            before=done.before,
            after=done.after,
        )
        if done.after == "cancelled" and done.changed:
            text = f"run cancelled (was {done.before})"
        elif not done.changed and done.before in ("succeeded", "failed", "cancelled"):
            text = f"the run is {done.before}: nothing to cancel"
        else:
            text = "cancellation requested: the attempt runs its cleanup hooks, then stops"
        return _back(path, notice=text)

    async def run_retry(request: Request, form: Form, session: auth.Session) -> Response:
        run_id = request.path_params["run_id"]
        path = f"/runs/{run_id}"
        try:
            rid = uuid.UUID(run_id)
            async with dash.acting() as conn:
                done = await operator.retry(
                    conn, rid, actor=session.actor, reason=form.get("reason") or None
                )
        except (WorkerError, ValueError) as exc:
            return _back(path, error=_message(exc))
        except psycopg.Error as exc:
            return _back(path, error=_database(exc))
        log.info("dashboard_retry", run_id=run_id, user=session.user, retried=done.retried)
        if done.retried:
            text = (
                f"run requeued on {done.lane} (was {done.before}); "
                f"next attempt {done.after_attempt + 1}"
            )
        else:
            text = f"the run is {done.before}: nothing to retry"
        return _back(path, notice=text)

    # ---- lanes -------------------------------------------------------------------------------

    async def lanes_page(request: Request) -> Response:
        async with dash.reader.connection() as conn:
            view = await dashboard.lanes_view(conn)
        return dash.render(request, "lanes.html", {"v": view, "rules": policy.RULES})

    async def lane_policy(request: Request, form: Form, session: auth.Session) -> Response:
        release = request.path_params["release"]
        values = {k: v for k, v in form.items() if k in policy.RULES}
        try:
            change = policy.parse(values, names="column")
            async with dash.acting() as conn:
                lane, diff = await operator.set_policy(
                    conn, release, change, actor=session.actor, names="column"
                )
        except WorkerError as exc:
            return _back("/lanes", error=_message(exc))
        except psycopg.Error as exc:
            return _back("/lanes", error=_database(exc))
        log.info("dashboard_set_policy", lane=lane.name, user=session.user, changed=diff)
        shown = ", ".join(f"{k} {v[0]:g} -> {v[1]:g}" for k, v in diff.items()) or "no change"
        return _back("/lanes", notice=f"{lane.name}: {shown}")

    async def lane_drain(request: Request, form: Form, session: auth.Session) -> Response:
        release = request.path_params["release"]
        if form.get("confirm", "").strip() != release:
            return _back("/lanes", error=f"type the release {release!r} to confirm the drain")
        try:
            async with dash.acting() as conn:
                lane = await operator.drain(conn, release, actor=session.actor)
        except WorkerError as exc:
            return _back("/lanes", error=_message(exc))
        except psycopg.Error as exc:
            return _back("/lanes", error=_database(exc))
        log.info("dashboard_drain", lane=lane.name, user=session.user)
        return _back("/lanes", notice=f"lane {lane.name} is draining: it admits no new runs")

    async def lane_reclaim(request: Request, form: Form, session: auth.Session) -> Response:
        release = request.path_params["release"]
        if form.get("confirm", "").strip() != release:
            return _back("/lanes", error=f"type the release {release!r} to confirm the reclaim")
        try:
            async with dash.acting() as conn:
                report = await operator.reclaim(
                    conn, release, actor=session.actor, force=form.get("force") == "1"
                )
        except WorkerError as exc:
            return _back("/lanes", error=_message(exc))
        except psycopg.Error as exc:
            return _back("/lanes", error=_database(exc))
        log.info("dashboard_reclaim", lane=report.lane, user=session.user)
        left = f"; {report.unfinished} unfinished run(s) stay on it" if report.unfinished else ""
        return _back("/lanes", notice=f"lane {report.lane} reclaimed (was {report.was}){left}")

    # ---- metrics -----------------------------------------------------------------------------

    async def stats_page(request: Request) -> Response:
        async with dash.reader.connection() as conn:
            view = await dashboard.stats_view(conn)
        chart = charts.throughput(view.minutes)
        return dash.render(request, "stats.html", {"v": view, "chart": chart})

    async def costs_page(request: Request) -> Response:
        params = request.query_params
        problems: list[str] = []
        org = (params.get("org") or "").strip() or None
        unit = (params.get("unit") or "").strip() or None
        try:
            org = fields.org(org) if org is not None else None
            unit = costs.check_unit(unit) if unit is not None else None
        except InvalidField as exc:
            problems.append(exc.render())
            org = unit = None
        async with dash.reader.connection() as conn:
            view = await dashboard.costs_view(conn, org=org, unit=unit)
        shown = view.unit or ""
        return dash.render(
            request,
            "costs.html",
            {
                "v": view,
                "org": org or "",
                "problems": problems,
                "by_org": charts.spend(view.days, view.by_org, shown, "org"),
                "by_provider": charts.spend(view.days, view.by_provider, shown, "provider"),
            },
        )

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def home(request: Request) -> Response:
        return RedirectResponse("/runs", status_code=303)

    return Starlette(
        middleware=[Middleware(_SecurityHeaders)],
        routes=[
            Route("/", page(home)),
            Route("/login", login_page, methods=["GET"]),
            Route("/login", login, methods=["POST"]),
            Route("/logout", action(logout), methods=["POST"]),
            Route("/runs", page(runs_page)),
            Route("/runs/{run_id}", page(run_page)),
            Route("/runs/{run_id}/cancel", action(run_cancel), methods=["POST"]),
            Route("/runs/{run_id}/retry", action(run_retry), methods=["POST"]),
            Route("/lanes", page(lanes_page)),
            Route("/lanes/{release}/policy", action(lane_policy), methods=["POST"]),
            Route("/lanes/{release}/drain", action(lane_drain), methods=["POST"]),
            Route("/lanes/{release}/reclaim", action(lane_reclaim), methods=["POST"]),
            Route("/stats", page(stats_page)),
            Route("/costs", page(costs_page)),
            Route("/healthz", health),
            Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
        ],
    )


def _message(exc: BaseException) -> str:
    if isinstance(exc, WorkerError):
        return f"error[{exc.code}]: {exc.render()}"
    return str(exc)


def _database(exc: psycopg.Error) -> str:
    mapped = translate(exc)
    if mapped is not None:
        return _message(mapped)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"error[DATABASE_ERROR]: {first}"
