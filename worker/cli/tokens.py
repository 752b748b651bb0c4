"""``worker token mint``: an attempt token for operators and tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import click

from queues import authority, runs
from queues.errors import RunNotFound
from worker import config, db
from worker.cli.common import Duration, State, emit_json, json_option, parse_run_id, pass_state, run


@click.group("token")
def token_group() -> None:
    """Attempt tokens (what a sandboxed play presents to the gateway)."""


@token_group.command("mint")
@click.option("--run", "run_id", required=True, metavar="RUN", help="The run.")
@click.option(
    "--capability",
    "capabilities",
    multiple=True,
    required=True,
    metavar="CAP",
    help=f"Repeatable: {', '.join(sorted(authority.KNOWN_CAPABILITIES))}.",
)
@click.option(
    "--ttl",
    "ttl_s",
    type=Duration(maximum=86400),
    default="60s",
    show_default=True,
    help="Lifetime.",
)
@json_option
@pass_state
def token_mint(
    state: State, run_id: str, capabilities: tuple[str, ...], ttl_s: float, as_json: bool
) -> None:
    """Mint a token for RUN's current attempt (operators and tests)."""
    rid = parse_run_id(run_id, field="--run")
    secret = config.token_secret(state.explicit_url, home=state.home)

    async def go() -> dict[str, Any]:
        async with db.session(state.url_for(config.Purpose.READ)) as conn:
            run = await runs.get(conn, rid)
            cur = await conn.execute("SELECT authority FROM wq_runs WHERE id = %s", (rid,))
            row = await cur.fetchone()
        if row is None:
            raise RunNotFound(f"no run {rid}", fix="check the id with `worker runs list`")
        descriptor = authority.Descriptor.from_json(
            rid, {"org": run.org, "play": run.play, "release": run.release} | (row[0] or {})
        )
        owner = run.lease_owner or "none"
        now = datetime.now(UTC)
        token = authority.mint(
            descriptor,
            attempt=max(run.attempt, 1),
            owner=owner,
            capabilities=capabilities,
            secret=secret,
            ttl_s=ttl_s,
            now=now,
        )
        return {
            "token": token,
            "run_id": str(rid),
            "attempt": max(run.attempt, 1),
            "owner": owner,
            "capabilities": sorted(capabilities),
            "expires_at": now + timedelta(seconds=ttl_s),
        }

    data = run(go())
    if as_json:
        emit_json(data)
    else:
        click.echo(data["token"])
