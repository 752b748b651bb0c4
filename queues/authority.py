"""Run authority: the descriptor admission records, and the attempt tokens minted from it.

Admission stores the run's **authority descriptor** (``wq_runs.authority``): the immutable
facts of the run (org, play, run, release) and the capabilities it was granted. No bearer
token rests in the database. Each attempt mints, from the descriptor, two signed, expiring
tokens at once:

- the **executor token**: the run's granted capabilities, for the play's runtime actions;
- the **run-ledger token**: one capability only, ``run.ledger.project``, for keyed outbox
  deliveries to the run's ledger (see :func:`queues.operations.capability_for_request`).

Both bind org, play, run, release, the attempt and the worker holding its lease, so a
receiver can check the request's run scope and the fence (a token of an attempt that a
rescue or a newer attempt superseded is refused by the fence, however unexpired). Minted
per attempt, not once at admission as the reference runtime's are: no token outlives its
attempt's lease, and the worker holding the lease is the delivery lease owner a ledger
delivery must name (:func:`queues.operations.authorize`).

Both carry the reference runtime's origin claims when the attempt's gateway is known (a
sandboxed attempt's): ``runtimeOrigin``, the origin of the runtime the token is for, and on
the run-ledger token ``runLedgerIngressPrefixOrigin``, the receiver its ledger deliveries
go to. Here both receivers are the one gateway, so both name its origin. No receiver of
this project reads them (the fence and the run scope decide); they are carried so a token
means the same to a receiver of the reference's.

A sandboxed play's executor token is narrower still (least authority): it names the plays
the attempt may spawn (``spawn``) and the rate-limit keys it may take permits of
(``limits``), what the play declared (``@registry.play(..., may_spawn=[...],
limits=[...])``); a receiver refuses any other with 403
(:func:`queues.operations.authorize`). A token without these claims is not restricted by
them (an in-process attempt's claims, a token an operator minted).

Tokens are JWTs signed with HS256 (PyJWT): a standard format any receiver can verify with
the shared secret. The secret comes from the environment (``WORKER_TOKEN_SECRET``); the
embedded database's default derives one from its own secret (kept with mode 0600).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from queues.errors import InvalidField, TokenInvalid
from queues.fence import Fence

ISSUER = "wq"
ALGORITHM = "HS256"
LEDGER_PROJECT = "run.ledger.project"
# The reference runtime's origin claims (see the module's docstring).
RUNTIME_ORIGIN = "runtimeOrigin"
LEDGER_INGRESS_ORIGIN = "runLedgerIngressPrefixOrigin"
# What an admitted run may do through the runtime (its executor token's capabilities).
EXECUTOR_CAPABILITIES: tuple[str, ...] = (
    "sheet.write",
    "receipt.write",
    "event.emit",
    "run.read",
    "limit.acquire",  # permits of shared rate limits (queues.limits)
    "run.spawn",  # child runs (queues.children)
)
KNOWN_CAPABILITIES = frozenset({*EXECUTOR_CAPABILITIES, LEDGER_PROJECT})
DEFAULT_TTL_S = 15 * 60.0
MIN_SECRET_BYTES = 32


@dataclass(frozen=True, slots=True)
class Descriptor:
    """The immutable facts of a run that its tokens are minted from."""

    org: str
    play: str
    run_id: uuid.UUID
    release: str
    capabilities: tuple[str, ...] = EXECUTOR_CAPABILITIES

    def as_json(self) -> dict[str, Any]:
        return {
            "org": self.org,
            "play": self.play,
            "run": str(self.run_id),
            "release": self.release,
            "capabilities": list(self.capabilities),
        }

    @classmethod
    def stored_texts(
        cls,
        runs: Sequence[tuple[str, str, str]],
        run_ids: Sequence[uuid.UUID],
        extra: Mapping[str, Any],
    ) -> list[str]:
        """What :meth:`as_json` stores with each run, over ``extra`` (the submitter's
        metadata), as JSON text: ``runs`` gives each run's (org, play, release) and
        ``run_ids`` its id. A batch's runs mostly share the first three, so the text of
        everything but the id is made once per distinct triple."""
        shared: dict[tuple[str, str, str], str] = {}
        out = []
        for (org, play, release), run_id in zip(runs, run_ids, strict=True):
            rest = shared.get((org, play, release))
            if rest is None:
                fields = dict(extra) | cls(org, play, run_id, release).as_json()
                del fields["run"]
                rest = shared[org, play, release] = json.dumps(fields)[1:]  # '"org": ...}'
            out.append(f'{{"run": "{run_id}", {rest}')
        return out

    @classmethod
    def from_json(cls, run_id: uuid.UUID, data: Mapping[str, Any]) -> Descriptor:
        """The descriptor stored with a run (older runs stored no capabilities: the
        executor default)."""
        caps = data.get("capabilities")
        return cls(
            org=str(data["org"]),
            play=str(data["play"]),
            run_id=run_id,
            release=str(data["release"]),
            capabilities=tuple(caps) if isinstance(caps, list) else EXECUTOR_CAPABILITIES,
        )


@dataclass(frozen=True, slots=True)
class Claims:
    """What a verified token says: who may act, on which run, at which attempt."""

    org: str
    play: str
    run_id: uuid.UUID
    release: str
    attempt: int
    owner: str  # the worker holding the attempt's lease
    capabilities: frozenset[str]
    expires_at: datetime
    token_id: str
    # The plays it may spawn and the rate-limit keys it may take (None: not restricted).
    may_spawn: frozenset[str] | None = None
    may_limit: frozenset[str] | None = None

    @property
    def fence(self) -> Fence:
        return Fence(self.run_id, self.attempt, self.owner)


@dataclass(frozen=True, slots=True)
class AttemptTokens:
    executor: str
    ledger: str


def check_secret(secret: str | bytes) -> bytes:
    raw = secret.encode() if isinstance(secret, str) else secret
    if len(raw) < MIN_SECRET_BYTES:
        raise InvalidField(
            f"the token signing secret is {len(raw)} bytes long",
            field="WORKER_TOKEN_SECRET",
            rule=f"at least {MIN_SECRET_BYTES} bytes of randomness",
            fix="set it to e.g. the output of `python -c 'import secrets; "
            "print(secrets.token_urlsafe(48))'`, the same for every worker and gateway",
        )
    return raw


def mint(
    descriptor: Descriptor,
    *,
    attempt: int,
    owner: str,
    capabilities: Iterable[str],
    secret: str | bytes,
    ttl_s: float = DEFAULT_TTL_S,
    now: datetime | None = None,
    may_spawn: Iterable[str] | None = None,
    may_limit: Iterable[str] | None = None,
    runtime_origin: str | None = None,
    ledger_ingress_origin: str | None = None,
) -> str:
    """One signed, expiring token for an attempt, with ``capabilities`` (a subset of what
    the run was granted, plus the ledger projection capability every run has); with
    ``may_spawn`` / ``may_limit``, restricted to those plays and rate-limit keys; with
    ``runtime_origin`` / ``ledger_ingress_origin``, the reference's ``runtimeOrigin`` and
    ``runLedgerIngressPrefixOrigin`` claims (absent otherwise, as the reference leaves
    them)."""
    caps = sorted(set(capabilities))
    allowed = {*descriptor.capabilities, LEDGER_PROJECT}
    unknown = [c for c in caps if c not in allowed]
    if unknown or not caps:
        raise InvalidField(
            f"capabilities {unknown or caps} are not granted to run {descriptor.run_id}",
            field="capability",
            rule=f"one or more of {', '.join(sorted(allowed))}",
            fix="mint with a capability the run's authority grants",
        )
    if not (0 < ttl_s <= 24 * 3600):
        raise InvalidField(
            f"token ttl {ttl_s}s", field="ttl", rule="0 < ttl <= 24h", fix="pass e.g. 60s"
        )
    issued = now or datetime.now(UTC)
    claims = {
        "iss": ISSUER,
        "sub": str(descriptor.run_id),
        "org": descriptor.org,
        "play": descriptor.play,
        "run": str(descriptor.run_id),
        "release": descriptor.release,
        "attempt": attempt,
        "owner": owner,
        "caps": caps,
        "iat": int(issued.timestamp()),
        "exp": int((issued + timedelta(seconds=ttl_s)).timestamp()),
        "jti": uuid.uuid4().hex,
    }
    if may_spawn is not None:
        claims["spawn"] = sorted(set(may_spawn))
    if may_limit is not None:
        claims["limits"] = sorted(set(may_limit))
    if runtime_origin is not None:
        claims[RUNTIME_ORIGIN] = runtime_origin
    if ledger_ingress_origin is not None:
        claims[LEDGER_INGRESS_ORIGIN] = ledger_ingress_origin
    import jwt  # here, not at the top: admission and the CLI's other commands never sign

    return jwt.encode(claims, check_secret(secret), algorithm=ALGORITHM)


def mint_attempt(
    descriptor: Descriptor,
    *,
    attempt: int,
    owner: str,
    secret: str | bytes,
    ttl_s: float = DEFAULT_TTL_S,
    now: datetime | None = None,
    may_spawn: Iterable[str] | None = None,
    may_limit: Iterable[str] | None = None,
    origin: str | None = None,
) -> AttemptTokens:
    """The two tokens of an attempt: the executor's (the run's capabilities, restricted to
    ``may_spawn`` and ``may_limit`` when given) and the narrow run-ledger one
    (``run.ledger.project`` only). ``origin`` is the gateway's, the attempt's runtime and
    its ledger's receiver alike: both tokens carry it as ``runtimeOrigin``, the run-ledger
    token as ``runLedgerIngressPrefixOrigin`` too."""
    return AttemptTokens(
        executor=mint(
            descriptor,
            attempt=attempt,
            owner=owner,
            capabilities=descriptor.capabilities,
            secret=secret,
            ttl_s=ttl_s,
            now=now,
            may_spawn=may_spawn,
            may_limit=may_limit,
            runtime_origin=origin,
        ),
        ledger=mint(
            descriptor,
            attempt=attempt,
            owner=owner,
            capabilities=[LEDGER_PROJECT],
            secret=secret,
            ttl_s=ttl_s,
            now=now,
            runtime_origin=origin,
            ledger_ingress_origin=origin,
        ),
    )


def verify(token: str | None, *, secret: str | bytes, now: datetime | None = None) -> Claims:
    """The claims of a token signed with ``secret`` and not expired, or :class:`TokenInvalid`."""
    if not token:
        raise TokenInvalid(
            "no token: the request carries no `Authorization: Bearer` credential",
            fix="send the attempt's token",
        )
    import jwt  # here, not at the top: admission and the CLI's other commands never verify

    try:
        data = jwt.decode(
            token,
            check_secret(secret),
            algorithms=[ALGORITHM],
            issuer=ISSUER,
            options={"require": ["exp", "iat", "sub", "iss"], "verify_exp": now is None},
        )
    except jwt.ExpiredSignatureError as exc:
        raise TokenInvalid("the token has expired", fix="mint a fresh attempt token") from exc
    except jwt.PyJWTError as exc:
        raise TokenInvalid(
            f"the token is not valid: {exc}", fix="send a token this deployment minted"
        ) from exc
    if now is not None and int(now.timestamp()) >= int(data["exp"]):
        raise TokenInvalid("the token has expired", fix="mint a fresh attempt token")
    try:
        return Claims(
            org=str(data["org"]),
            play=str(data["play"]),
            run_id=uuid.UUID(str(data["run"])),
            release=str(data["release"]),
            attempt=int(data["attempt"]),
            owner=str(data["owner"]),
            capabilities=frozenset(str(c) for c in data["caps"]),
            expires_at=datetime.fromtimestamp(int(data["exp"]), UTC),
            token_id=str(data["jti"]),
            may_spawn=_names(data, "spawn"),
            may_limit=_names(data, "limits"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TokenInvalid(
            f"the token lacks a claim: {exc}", fix="send a token this deployment minted"
        ) from exc


def _names(data: Mapping[str, Any], claim: str) -> frozenset[str] | None:
    """A restricting claim (a list of names), or None when the token has none."""
    if claim not in data:
        return None
    names = data[claim]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"the {claim} claim is not a list of names")
    return frozenset(names)


_NEVER = datetime.max.replace(tzinfo=UTC)  # an in-process attempt's claims do not expire


def claims_of_attempt(
    descriptor: Descriptor,
    *,
    attempt: int,
    owner: str,
    capabilities: Iterable[str] | None = None,
) -> Claims:
    """The claims of an in-process attempt: the same authority as its tokens (the
    executor's by default), without signing one (an in-process play shares the worker's
    process)."""
    return Claims(
        org=descriptor.org,
        play=descriptor.play,
        run_id=descriptor.run_id,
        release=descriptor.release,
        attempt=attempt,
        owner=owner,
        capabilities=frozenset(descriptor.capabilities if capabilities is None else capabilities),
        expires_at=_NEVER,
        token_id="in-process",
    )
