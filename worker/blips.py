"""What counts as a blip: a call that failed because its connection went away, not because
it was refused (docs/design.md, section 11c). One rule for every loop that rides an
outage (the worker's, the recovery loop's, the projector's, the clients that wait) and for
the attempt's transport (:class:`worker.contract.Absorbing`).

Kept apart from :mod:`worker.contract` so a command that only waits out outages (``worker
submit``, ``worker result --wait``) does not import the HTTP client and the operation
contract to answer the question: an exception of a library that was never imported cannot
have been raised.
"""

from __future__ import annotations

import sys

import psycopg

from queues.errors import DatabaseUnreachable

# SQLSTATEs of a lost or refused connection and of a transaction the server rolled back:
# class 08 (connection exception), class 40 (serialization failure, deadlock), and the
# shutdown codes of class 57P (administrator command, crash, not accepting connections
# yet). A statement timeout (57014) or a lock timeout (55P03) is not one: sending the
# same statement again would meet the same wait.
_BLIP_CLASSES = ("08", "40")
_BLIP_STATES = frozenset({"57P01", "57P02", "57P03"})
# Errors of libraries imported only by the processes that use them: a pool with no
# connection to give, a gateway that could not be reached or did not answer.
_LOADED_BLIPS = (("psycopg_pool", "PoolTimeout"), ("httpx", "TransportError"))


def is_blip(exc: BaseException) -> bool:
    """Whether a call failed because its connection went away, not because it was refused:
    a connection lost with no answer (psycopg's client-side errors carry no SQLSTATE), one
    of the SQLSTATEs above, a pool with no connection to give, a gateway that answered
    ``DATABASE_UNREACHABLE``, or a gateway that could not be reached or did not answer."""
    if isinstance(exc, DatabaseUnreachable):
        return True
    if isinstance(exc, psycopg.OperationalError):
        state = exc.sqlstate
        return state is None or state[:2] in _BLIP_CLASSES or state in _BLIP_STATES
    for module, name in _LOADED_BLIPS:
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(exc, getattr(loaded, name)):
            return True
    return False
