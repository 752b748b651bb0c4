"""The documentation site builds, strictly, and its reference is generated from the code.

``mkdocs build --strict`` (a broken link, a page missing from the navigation, a reference
part that cannot be rendered, an environment variable the code reads and the docs do not
describe: each fails it) into a temporary directory; then the built reference must hold
what the code defines, looked up in the code here, not written down: every command and
option of the click app, every error code of ``queues.errors``, every exit status, every
metric family, every runtime action, every table of ``sql/schema.sql`` and every secret
variable. A fence without a language fails too: each block says whether it runs.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from queues import errors, operations
from worker import config, instruments
from worker.cli import cli

cli.loaded()  # the commands load lazily; these tests walk all of them

ROOT = Path(__file__).resolve().parents[2]
# The fences' languages: python runs, sh/yaml/json are checked (tests/docs/conftest.py),
# the others are shown as they are.
LANGUAGES = {"python", "sh", "yaml", "json", "text", "ini", "sql", "csv"}
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    ran = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(built)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return built


def page(site: Path, name: str) -> str:
    return html.unescape((site / name / "index.html").read_text())


def _commands(command: click.Command, path: str) -> list[tuple[str, click.Command]]:
    found = [(path, command)]
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            found += _commands(sub, f"{path} {name}")
    return found


def test_every_command_and_option_is_in_the_built_cli_reference(site: Path) -> None:
    built = page(site, "reference/cli")
    for path, command in _commands(cli, "worker"):
        if path != "worker":
            assert f'id="{path.replace(" ", "-")}"' in built, path
        for param in command.params:
            if isinstance(param, click.Argument):
                assert param.human_readable_name in built, f"{path} {param.name}"
                continue
            for option in (*param.opts, *param.secondary_opts):
                assert option in built, f"{path} {option}"
    start = cli.commands["start"]
    assert any("--max-connections" in p.opts for p in start.params)
    assert "WORKER_MAX_CONNECTIONS" in built


def test_every_error_code_and_exit_status_is_in_the_built_reference(site: Path) -> None:
    built = page(site, "reference/errors")
    classes: list[type[errors.WorkerError]] = [
        errors.WorkerError,
        *_subclasses(errors.WorkerError),
    ]
    assert len(classes) > 20
    for cls in classes:
        assert f"<code>{cls.code}</code>" in built, cls.code
    for status in errors.ExitCode:
        assert f"<code>{status.name}</code>" in built, status
    for state in errors.SQLSTATE_ERRORS:
        assert state in built


def _subclasses(cls: type[errors.WorkerError]) -> list[type[errors.WorkerError]]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def test_metrics_actions_tables_and_variables_are_in_the_built_reference(site: Path) -> None:
    metrics = page(site, "reference/metrics")
    for metric in instruments.PROCESS_METRICS:
        assert metric._name in metrics
    for family in ("wq_runs_admitted_total", "wq_queue_depth", "wq_database_up"):
        assert family in metrics
    gateway = page(site, "reference/gateway")
    for action in operations.ACTIONS:
        assert f"<code>{action}</code>" in gateway, action
    schema = page(site, "reference/schema")
    tables = re.findall(r"^CREATE TABLE public\.(\w+)", (ROOT / "sql/schema.sql").read_text(), re.M)
    assert "wq_runs" in tables
    for table in tables:
        assert f'id="{table}"' in schema, table
    settings = page(site, "reference/settings")
    for variable in config.SECRET_VARIABLES:
        assert f"<code>{variable}</code>" in settings, variable


def test_the_python_api_is_rendered_from_its_docstrings(site: Path) -> None:
    from worker.context import RunContext

    built = page(site, "reference/python-api")
    first_line = (RunContext.step.__doc__ or "").strip().splitlines()[0]
    assert first_line.split("``")[0].strip() in built


def test_every_fence_says_its_language() -> None:
    unlabelled = []
    for document in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        open_fence = None
        for number, line in enumerate(document.read_text().splitlines(), 1):
            found = _FENCE.match(line)
            if found is None:
                continue
            if open_fence is None:
                open_fence = found["fence"]
                language = found["info"].strip().split(" ")[0]
                if language not in LANGUAGES:
                    unlabelled.append(f"{document.relative_to(ROOT)}:{number}: {language!r}")
            elif found["fence"].startswith(open_fence) and not found["info"].strip():
                open_fence = None
    assert not unlabelled, f"fences need a language from {sorted(LANGUAGES)}: {unlabelled}"
