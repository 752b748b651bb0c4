"""No silent embedded database in production: detection and the one URL resolution."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from queues.errors import DatabaseUrlMissing, InputError, InvalidField
from worker import config, embedded

URL = "postgresql://app@db.internal:5432/app"


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({}, None),
        ({"CI": "true", "GITHUB_ACTIONS": "true"}, None),  # a CI runner is not production
        ({"WORKER_ENV": "production"}, "WORKER_ENV=production"),
        ({"WORKER_ENV": " Production "}, "WORKER_ENV=production"),
        ({"WORKER_ENV": "staging"}, "WORKER_ENV=staging"),
        ({"WORKER_ENV": "development"}, None),
        ({"WORKER_ENV": "test"}, None),
        # WORKER_ENV decides over a platform, both ways.
        ({"WORKER_ENV": "development", "DYNO": "web.1"}, None),
        ({"WORKER_ENV": "test", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),
        ({"WORKER_ENV": "production", "DYNO": "web.1"}, "WORKER_ENV=production"),
        ({"WORKER_ENV": "", "DYNO": "web.1"}, "DYNO is set (Heroku)"),
        ({"DYNO": ""}, None),  # empty is unset
        ({"DYNO": "release.42"}, "DYNO is set (Heroku)"),
        ({"RENDER": "true"}, "RENDER is set (Render)"),
        ({"RAILWAY_ENVIRONMENT_ID": "e1"}, "RAILWAY_ENVIRONMENT_ID is set (Railway)"),
        ({"RAILWAY_ENVIRONMENT": "production"}, "RAILWAY_ENVIRONMENT is set (Railway)"),
        ({"FLY_APP_NAME": "app"}, "FLY_APP_NAME is set (Fly.io)"),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "KUBERNETES_SERVICE_HOST is set (Kubernetes)"),
        ({"K_SERVICE": "api"}, "K_SERVICE is set (Cloud Run)"),
        (
            {"ECS_CONTAINER_METADATA_URI_V4": "http://169.254.170.2/v4/x"},
            "ECS_CONTAINER_METADATA_URI_V4 is set (Amazon ECS)",
        ),
        (
            {"ECS_CONTAINER_METADATA_URI": "http://169.254.170.2/v3/x"},
            "ECS_CONTAINER_METADATA_URI is set (Amazon ECS)",
        ),
        ({"AWS_LAMBDA_FUNCTION_NAME": "f"}, "AWS_LAMBDA_FUNCTION_NAME is set (AWS Lambda)"),
        ({"VERCEL": "1"}, "VERCEL is set (Vercel)"),
        ({"WEBSITE_SITE_NAME": "app"}, "WEBSITE_SITE_NAME is set (Azure App Service)"),
    ],
)
def test_production_reason(env: dict[str, str], reason: str | None) -> None:
    assert config.production_reason(env) == reason


def test_every_platform_variable_is_detected_alone() -> None:
    for name, platform in config.PLATFORM_VARIABLES:
        assert config.production_reason({name: "x"}) == f"{name} is set ({platform})"


@pytest.mark.parametrize("value", ["prod", "prodution", "live", "1"])
def test_unknown_worker_env_is_refused_not_guessed(value: str) -> None:
    with pytest.raises(InvalidField) as info:
        config.production_reason({"WORKER_ENV": value})
    assert info.value.exit_code == 2
    assert info.value.field == "WORKER_ENV"
    assert "production" in (info.value.rule or "") and "development" in (info.value.rule or "")


@pytest.fixture
def no_embedded(monkeypatch: pytest.MonkeyPatch) -> list[Path | None]:
    """Record embedded starts instead of starting a server."""
    started: list[Path | None] = []

    class Server:
        def url(self, *, role: str | None = None) -> str:
            return f"postgresql://{role or 'postgres'}@127.0.0.1:5999/worker"

    def ensure_running(home: Path | None = None, **_: Any) -> Server:
        started.append(home)
        return Server()

    monkeypatch.setattr(embedded, "ensure_running", ensure_running)
    return started


@pytest.mark.parametrize(
    "env",
    [{"WORKER_ENV": "production"}, {"DYNO": "web.1"}, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}],
)
def test_production_without_a_url_is_an_input_error(
    env: dict[str, str], no_embedded: list[Path | None]
) -> None:
    with pytest.raises(DatabaseUrlMissing) as info:
        config.resolve_url(None, env=env)
    exc = info.value
    assert isinstance(exc, InputError) and exc.exit_code == 2
    assert exc.code == "DATABASE_URL_MISSING"
    assert exc.field == "WORKER_DATABASE_URL"
    assert str(config.production_reason(env)) in exc.message
    assert exc.fix is not None
    assert "WORKER_DATABASE_URL or DATABASE_URL" in exc.fix
    assert "WORKER_ENV=development" in exc.fix
    assert no_embedded == []


@pytest.mark.parametrize(
    ("explicit", "env", "expected"),
    [
        (URL, {"WORKER_ENV": "production"}, URL),
        (None, {"WORKER_ENV": "production", "DATABASE_URL": URL}, URL),
        (None, {"DYNO": "web.1", "WORKER_DATABASE_URL": URL}, URL),
        # With a URL set, WORKER_ENV is not consulted at all.
        (None, {"WORKER_ENV": "prodution", "DATABASE_URL": URL}, URL),
    ],
)
def test_production_with_a_url_uses_it(
    explicit: str | None, env: dict[str, str], expected: str, no_embedded: list[Path | None]
) -> None:
    assert config.resolve_url(explicit, env=env) == expected
    assert no_embedded == []


@pytest.mark.parametrize("env", [{}, {"WORKER_ENV": "development", "DYNO": "web.1"}])
def test_development_without_a_url_uses_the_embedded_database(
    env: dict[str, str], no_embedded: list[Path | None], tmp_path: Path
) -> None:
    assert config.resolve_url(None, home=tmp_path, env=env).startswith("postgresql://wq_worker@")
    assert no_embedded == [tmp_path]
    # Each purpose logs in as its own role; only the migration gate as the superuser.
    purpose = config.Purpose
    assert config.resolve_url(None, home=tmp_path, env=env, purpose=purpose.MIGRATE).startswith(
        "postgresql://postgres@"
    )
    assert config.resolve_url(None, home=tmp_path, env=env, purpose=purpose.READ).startswith(
        "postgresql://wq_reader@"
    )
