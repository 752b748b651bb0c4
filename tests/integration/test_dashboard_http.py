"""The dashboard's guards over HTTP: login, sessions, CSRF and same-origin checks, the
security headers, and an action made with the worker role and recorded with its actor."""

from __future__ import annotations

import uuid

import httpx

from tests.dashboards import SECRET, logged_in, serving, token
from tests.workers import fetch, submit


async def test_pages_need_a_session(db_url: str) -> None:
    async with serving(db_url) as served, httpx.AsyncClient(base_url=served.url) as client:
        response = await client.get("/runs?state=failed")
        assert response.status_code == 303
        assert response.headers["location"] == "/login?next=%2Fruns%3Fstate%3Dfailed"
        assert (await client.get("/healthz")).text == "ok"
        refused = await client.post("/runs/x/cancel", headers={"Origin": served.url})
        assert refused.status_code == 403


async def test_login_takes_the_secret_and_sets_a_strict_cookie(db_url: str) -> None:
    async with serving(db_url) as served, httpx.AsyncClient(base_url=served.url) as client:
        page = await client.get("/login")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-frame-options"] == "DENY"
        login = token(page.text, "login_csrf")
        form = {"name": "alice", "secret": "wrong", "login_csrf": login, "next": "/runs"}
        wrong = await client.post("/login", data=form, headers={"Origin": served.url})
        assert wrong.status_code == 303 and "failed=1" in wrong.headers["location"]
        assert "wq_session" not in wrong.cookies
        form["secret"] = SECRET
        cross = await client.post("/login", data=form, headers={"Origin": "http://evil.test"})
        assert cross.status_code == 403
        no_token = await client.post(
            "/login", data=form | {"login_csrf": "guess"}, headers={"Origin": served.url}
        )
        assert no_token.status_code == 403
        ok = await client.post("/login", data=form, headers={"Origin": served.url})
        assert ok.status_code == 303 and ok.headers["location"] == "/runs"
        cookie = ok.headers["set-cookie"].lower()
        assert "wq_session=" in cookie and "httponly" in cookie and "samesite=strict" in cookie
        runs = await client.get("/runs")
        assert runs.status_code == 200 and "alice" in runs.text


async def test_an_action_needs_the_sessions_token_and_the_same_origin(db_url: str) -> None:
    run_id = await submit(db_url, "nobody-serves-this")  # queued: a cancel is at once
    async with serving(db_url) as served, logged_in(served.url) as client:
        page = await client.get(f"/runs/{run_id}")
        assert page.status_code == 200 and "Cancel run" in page.text
        csrf = token(page.text)
        path = f"/runs/{run_id}/cancel"
        missing = await client.post(path, data={}, headers={"Origin": served.url})
        assert missing.status_code == 403
        forged = await client.post(path, data={"csrf": "x"}, headers={"Origin": served.url})
        assert forged.status_code == 403
        cross = await client.post(path, data={"csrf": csrf}, headers={"Origin": "http://evil.test"})
        assert cross.status_code == 403
        bare = await client.post(path, data={"csrf": csrf})  # no Origin, no Referer
        assert bare.status_code == 403
        assert (await fetch(db_url, "SELECT state::text FROM wq_runs WHERE id = %s", (run_id,)))[0][
            0
        ] == "queued"
        done = await client.post(
            path,
            data={"csrf": csrf, "reason": "wrong list"},
            headers={"Referer": f"{served.url}/runs/{run_id}"},
        )
        assert done.status_code == 303 and "notice=" in done.headers["location"]
    rows = await fetch(
        db_url,
        "SELECT r.state::text, e.data ->> 'by', e.data ->> 'reason' FROM wq_runs r "
        "JOIN wq_ledger e ON e.run_id = r.id AND e.kind = 'run_cancelled' WHERE r.id = %s",
        (run_id,),
    )
    assert rows == [("cancelled", "dashboard:alice", "wrong list")]
    actors = await fetch(
        db_url, "SELECT actor, action FROM wq_operator_actions WHERE run_id = %s", (run_id,)
    )
    assert actors == [("dashboard:alice", "cancel")]


async def test_a_refused_policy_is_shown_and_writes_nothing(db_url: str) -> None:
    await submit(db_url, "noop", release="t")  # prepares lane r-t
    async with serving(db_url) as served, logged_in(served.url) as client:
        page = await client.get("/lanes")
        csrf = token(page.text)
        bad = await client.post(
            "/lanes/t/policy",
            data={"csrf": csrf, "concurrency": "0", "lease_ttl_s": "30s"},
            headers={"Origin": served.url},
        )
        assert bad.status_code == 303
        shown = await client.get(bad.headers["location"])
        assert "error[FIELD_INVALID]" in shown.text and "concurrency" in shown.text
        good = await client.post(
            "/lanes/t/policy",
            data={"csrf": csrf, "concurrency": "4", "lease_ttl_s": "45s"},
            headers={"Origin": served.url},
        )
        assert "notice=" in good.headers["location"]
        unknown = await client.get(f"/runs/{uuid.uuid4()}")
        assert unknown.status_code == 404
    rows = await fetch(db_url, "SELECT concurrency, lease_ttl_s FROM wq_lanes WHERE name = 'r-t'")
    assert rows == [(4, 45.0)]
    audit = await fetch(db_url, "SELECT actor, action FROM wq_operator_actions")
    assert audit == [("dashboard:alice", "set_policy")]
