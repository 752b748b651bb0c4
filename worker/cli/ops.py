"""The operator's commands: ``worker runs retry``, ``worker queues set-policy`` and
``worker dashboard``: thin wrappers over :mod:`queues.operator` and :mod:`worker.dashboard`.

Actions connect with the worker role (the narrowest that may act) and record who acted as
``cli:<login name>`` (:func:`worker.cli.common.actor`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import sys
from collections.abc import Callable
from typing import Any

import click
import structlog

from queues import fields, migrations, operator, policy
from worker import config, stopping
from worker.cli.common import (
    Conn,
    State,
    actor,
    connected,
    emit_json,
    json_option,
    parse_run_id,
    pass_state,
)

log = structlog.get_logger("worker.cli")


# ---- worker runs retry ----------------------------------------------------------------------


@click.command("retry")
@click.argument("run_id", metavar="RUN")
@click.option("--reason", default=None, help="Why (recorded in the run's ledger).")
@json_option
@pass_state
def retry_command(state: State, run_id: str, reason: str | None, as_json: bool) -> None:
    """Run a failed or cancelled RUN again, as the same run: a new attempt sequence on its
    own lane, with its completed steps replayed from their receipts (not paid again)."""
    rid = parse_run_id(run_id)

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        done = await operator.retry(conn, rid, actor=actor(), reason=reason)
        if as_json:
            emit_json(
                {
                    "run_id": str(done.run_id),
                    "retried": done.retried,
                    "before": done.before,
                    "lane": done.lane,
                    "job_id": done.job_id,
                    "next_attempt": done.after_attempt + 1 if done.retried else None,
                }
            )
        elif done.retried:
            click.echo(
                f"run {rid} retried (was {done.before}): queued on lane {done.lane}; its next "
                f"attempt is {done.after_attempt + 1}, with a fresh retry budget; completed "
                "steps replay from their receipts"
            )
        else:
            click.echo(
                f"run {rid} is {done.before}: nothing to retry (it has not finished, or "
                "another retry queued it first)"
            )
        return 0

    connected(state, go)


# ---- worker queues set-policy -----------------------------------------------------------------


def _policy_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for column, rule in reversed(list(policy.RULES.items())):
        unit = " (e.g. 30s, 5m, 7d)" if rule.kind == "duration" else ""
        f = click.option(
            rule.flag,
            column,
            default=None,
            metavar=rule.kind.upper(),
            help=f"{rule.help[:1].upper()}{rule.help[1:]}{unit}.",
        )(f)
    return f


@click.command("set-policy")
@click.argument("release", metavar="RELEASE")
@_policy_options
@json_option
@pass_state
def set_policy_command(state: State, /, release: str, as_json: bool, **values: str | None) -> None:
    """Change the policy of RELEASE's lane (r-RELEASE): concurrency, lease TTL, heartbeat,
    retries, interruptions, retention, the runs' default timeout and a per-org cap on
    running runs. Every value is checked before anything is written.
    Lease and retry values apply from each run's next claim; a worker's concurrency and
    heartbeat period from its next start."""
    name = fields.Release(release, field="RELEASE")
    change = policy.parse(values)

    async def go(conn: Conn) -> int:
        await migrations.verify_contract(conn)
        lane, diff = await operator.set_policy(conn, name, change, actor=actor())
        if as_json:
            emit_json({"lane": lane.name, "changed": diff})
        elif diff:
            for column, (old, new) in diff.items():
                click.echo(
                    f"lane {lane.name}: {column} {_shown(column, old)} -> {_shown(column, new)}"
                )
        else:
            click.echo(f"lane {lane.name}: unchanged (it already had these values)")
        return 0

    connected(state, go)


def _shown(column: str, value: Any) -> str:
    rule = policy.RULES[column]
    if rule.kind == "duration" and isinstance(value, int | float):
        return fields.human_duration(float(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


# ---- worker dashboard ---------------------------------------------------------------------------


@click.command("dashboard")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8086, show_default=True)
@pass_state
def dashboard_command(state: State, host: str, port: int) -> None:
    """Serve the web dashboard: runs, a run's attempts, ledger, progress and traceback,
    lanes and their policies, metrics. Log in with the dashboard secret.

    A lost database (a restart, a failover) does not stop it: pages answer 503 while
    nothing answers, their live parts keep polling, and they are live again as soon as
    the database answers (a multi-host URL finds the new primary)."""
    from worker import dashboard
    from worker.dashboard import auth

    stopping.latch()
    config.hand_off_secrets()  # its login secret and URLs leave its environment
    secret, source = auth.resolve_secret(home=state.home)
    reader_url = state.url_for(config.Purpose.READ)
    worker_url = state.url_for(config.Purpose.WORKER)
    if not _loopback(host):
        log.warning(
            "dashboard_not_on_loopback",
            host=host,
            detail="serve it behind a TLS proxy: the login secret and the session cookie "
            "cross the network",
        )

    async def serve() -> int:
        stop = asyncio.Event()
        stopping.on_stop_signals(stop.set)
        running = await dashboard.start(
            reader_url=reader_url, worker_url=worker_url, secret=secret, host=host, port=port
        )
        where = "$" + source if source == auth.SECRET_VARIABLE else f"the file {source}"
        log.info("dashboard_serving", url=running.url)
        click.echo(
            f"dashboard serving on {running.url}; log in with the secret in {where}", err=True
        )
        try:
            await stop.wait()
        finally:
            await running.stop()
        return 0

    sys.exit(asyncio.run(serve()))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
