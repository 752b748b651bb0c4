"""The settings every connection gets (worker.db.connect_kwargs): the operator's own wins."""

from __future__ import annotations

import pytest

from worker import db
from worker.config import PoolMode

URL = "postgresql://u@127.0.0.1:5432/d"


def test_a_part_of_the_process_names_its_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGAPPNAME", raising=False)
    kwargs = db.connect_kwargs(URL, mode=PoolMode.SESSION, application="wq-result")
    assert kwargs["application_name"] == "wq-result"
    assert kwargs["connect_timeout"] == db.CONNECT_TIMEOUT_S


def test_a_name_the_url_or_the_environment_gives_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGAPPNAME", raising=False)
    given = db.connect_kwargs(
        URL + "?application_name=deploy-hook", mode=PoolMode.SESSION, application="wq-result"
    )
    assert "application_name" not in given  # libpq takes the URL's
    monkeypatch.setenv("PGAPPNAME", "deploy-hook")
    from_env = db.connect_kwargs(URL, mode=PoolMode.SESSION, application="wq-result")
    assert "application_name" not in from_env  # libpq takes PGAPPNAME


def test_a_transaction_pooler_gets_no_prepared_statements() -> None:
    kwargs = db.connect_kwargs(URL, mode=PoolMode.TRANSACTION)
    assert kwargs["prepare_threshold"] is None
    assert "prepare_threshold" not in db.connect_kwargs(URL, mode=PoolMode.SESSION)
