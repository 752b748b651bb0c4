"""The dashboard's sessions end at logout, on the server, and its logins are throttled per
client and overall (a real dashboard on loopback)."""

from __future__ import annotations

import asyncio

import httpx

from tests.dashboards import SECRET, logged_in, serving, token
from worker.dashboard import auth


async def test_logout_revokes_the_cookie_wherever_it_was_copied(db_url: str) -> None:
    async with serving(db_url) as served, logged_in(served.url) as client:
        cookie = client.cookies[auth.SESSION_COOKIE]
        page = await client.get("/runs")
        assert page.status_code == 200
        out = await client.post(
            "/logout", data={"csrf": token(page.text)}, headers={"Origin": served.url}
        )
        assert out.status_code == 303 and out.headers["location"] == "/login"
        # A copy of the cookie, replayed after the logout (as one stolen before it would be).
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as thief:
            thief.cookies.set(auth.SESSION_COOKIE, cookie)
            replayed = await thief.get("/runs")
            assert replayed.status_code == 303
            assert replayed.headers["location"].startswith("/login")
            action = await thief.post(
                "/runs/x/cancel", data={"csrf": token(page.text)}, headers={"Origin": served.url}
            )
            assert action.status_code == 403


async def test_parallel_wrong_logins_are_throttled_with_retry_after(db_url: str) -> None:
    async with (
        serving(db_url) as served,
        httpx.AsyncClient(base_url=served.url, timeout=20) as client,
    ):
        page = await client.get("/login")
        form = {"name": "mallory", "secret": "guess", "login_csrf": token(page.text, "login_csrf")}

        async def attempt(secret: str) -> httpx.Response:
            return await client.post(
                "/login", data=form | {"secret": secret}, headers={"Origin": served.url}
            )

        answers = await asyncio.gather(*(attempt(f"guess-{i}") for i in range(40)))
        statuses = [a.status_code for a in answers]
        assert statuses.count(303) == auth.LOGIN_BURST, statuses  # wrong, and counted
        throttled = [a for a in answers if a.status_code == 429]
        assert len(throttled) == 40 - auth.LOGIN_BURST
        assert all(int(a.headers["retry-after"]) >= 1 for a in throttled)
        # Throttled is throttled, whatever the secret: guessing gains nothing by waiting less.
        right = await attempt(SECRET)
        assert right.status_code == 429 and "wq_session" not in right.cookies
