"""The supported Postgres range: a server below it is refused with the version found, the
range and the fix; every major in it, and a newer one, is served."""

from __future__ import annotations

import pytest

from queues import server
from queues.errors import PostgresUnsupported, WorkerError


@pytest.mark.parametrize(
    ("version_num", "major"),
    [(140000, 14), (140019, 14), (150018, 15), (160009, 16), (170005, 17), (180006, 18)],
)
def test_every_major_of_the_range_is_served(version_num: int, major: int) -> None:
    assert server.check_version(version_num) == major


def test_a_major_newer_than_the_range_is_served() -> None:
    assert server.check_version(190000) == 19


@pytest.mark.parametrize(
    ("version_num", "shown"),
    [(130021, "13.21"), (120022, "12.22"), (100023, "10.23"), (90624, "9.6.24")],
)
def test_a_server_below_the_range_is_refused_with_the_version_the_range_and_the_fix(
    version_num: int, shown: str
) -> None:
    with pytest.raises(PostgresUnsupported) as caught:
        server.check_version(version_num)
    error = caught.value
    assert isinstance(error, WorkerError)
    assert error.code == "POSTGRES_UNSUPPORTED"
    assert f"Postgres {shown}" in error.message
    assert f"Postgres {server.OLDEST_MAJOR} to {server.NEWEST_MAJOR}" in error.message
    assert error.fix is not None and "upgrade" in error.fix
    assert error.as_dict()["code"] == "POSTGRES_UNSUPPORTED"


def test_the_range_starts_at_14_and_ends_at_18() -> None:
    assert (server.OLDEST_MAJOR, server.NEWEST_MAJOR) == (14, 18)
    assert server.check_version(server.OLDEST_MAJOR * 10000) == server.OLDEST_MAJOR
    with pytest.raises(PostgresUnsupported):
        server.check_version(server.OLDEST_MAJOR * 10000 - 1)
