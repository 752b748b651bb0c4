"""Helpers for the dashboard's tests: login users in the reader and worker roles (as a
deployment makes them), a dashboard served in this event loop, and a logged-in client."""

from __future__ import annotations

import contextlib
import re
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from worker import dashboard

SECRET = "correct horse battery staple"


def as_user(url: str, user: str, password: str) -> str:
    params = {k: str(v) for k, v in conninfo_to_dict(url).items() if v is not None}
    params.update(user=user, password=password)
    return make_conninfo(**params)


@contextlib.asynccontextmanager
async def role_logins(db_url: str) -> AsyncIterator[dict[str, str]]:
    """A login user in each of wq_reader and wq_worker; URLs by role."""
    made: dict[str, str] = {}
    names: list[str] = []
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:
        for role in ("wq_reader", "wq_worker"):
            name = f"d_{role}_{uuid.uuid4().hex[:8]}"
            password = secrets.token_urlsafe(16)
            await admin.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                    sql.Identifier(name), sql.Literal(password), sql.Identifier(role)
                )
            )
            names.append(name)
            made[role] = as_user(db_url, name, password)
    try:
        yield made
    finally:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as admin:
            for name in names:
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                    (name,),
                )
                with contextlib.suppress(psycopg.Error):
                    await admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@dataclass
class Served:
    url: str
    reader_url: str
    worker_url: str


@contextlib.asynccontextmanager
async def serving(db_url: str) -> AsyncIterator[Served]:
    """The dashboard on a free loopback port, reading as wq_reader, acting as wq_worker."""
    async with role_logins(db_url) as urls:
        running = await dashboard.start(
            reader_url=urls["wq_reader"],
            worker_url=urls["wq_worker"],
            secret=SECRET,
            port=0,
        )
        try:
            yield Served(running.url, urls["wq_reader"], urls["wq_worker"])
        finally:
            await running.stop()


_TOKEN = re.compile(r'name="(csrf|login_csrf)" value="([^"]+)"')


def token(html: str, name: str = "csrf") -> str:
    for found, value in _TOKEN.findall(html):
        if found == name:
            return value
    raise AssertionError(f"no {name} field in the page")


@contextlib.asynccontextmanager
async def logged_in(base: str, name: str = "alice") -> AsyncIterator[httpx.AsyncClient]:
    """A client with a session (the login form, as a browser posts it)."""
    async with httpx.AsyncClient(base_url=base, timeout=20, follow_redirects=False) as client:
        page = await client.get("/login")
        response = await client.post(
            "/login",
            data={
                "name": name,
                "secret": SECRET,
                "login_csrf": token(page.text, "login_csrf"),
                "next": "/runs",
            },
            headers={"Origin": base},
        )
        assert response.status_code == 303, response.text
        assert response.headers["location"] == "/runs"
        yield client
