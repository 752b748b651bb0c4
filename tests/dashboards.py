"""Helpers for the dashboard's tests: login users in the reader and worker roles (as a
deployment makes them), a dashboard served in this event loop, and a logged-in client."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from tests.workers import login_users
from worker import dashboard

SECRET = "correct horse battery staple"


@dataclass
class Served:
    url: str
    reader_url: str
    worker_url: str


@contextlib.asynccontextmanager
async def serving(db_url: str) -> AsyncIterator[Served]:
    """The dashboard on a free loopback port, reading as wq_reader, acting as wq_worker."""
    async with login_users(db_url, ("wq_reader", "wq_worker")) as urls:
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
