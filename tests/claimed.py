"""A claimed run's row as a claim returns it, built without a database (unit tests)."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from queues import runs
from queues.authority import EXECUTOR_CAPABILITIES

RUN = uuid.uuid4()


def claimed(**changes: Any) -> runs.Claimed:
    """A usable row of run :data:`RUN`'s first attempt, with ``changes``."""
    good = runs.Claimed(
        claimed=True,
        run_id=RUN,
        attempt=1,
        org="acme",
        play="echo",
        params={"a": 1},
        lane="r-t",
        release="t",
        job_id=7,
        lease_expires_at=None,
        wake_payload=None,
        created_at=None,
        authority={
            "run": str(RUN),
            "org": "acme",
            "play": "echo",
            "release": "t",
            "capabilities": list(EXECUTOR_CAPABILITIES),
        },
        cleanup=False,
        lease_ttl_s=30.0,
        heartbeat_s=5.0,
        retry_max_attempts=5,  # the lane's default
        retry_base_s=1.0,
        retry_cap_s=10.0,
        retry_jitter=0.0,
        max_interruptions=3,
        failures=0,
        interruptions=0,
    )
    return dataclasses.replace(good, **changes)
