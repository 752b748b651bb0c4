"""The documentation's examples, run as tests (Sybil).

Collected with this directory (``pytest tests/docs``, and the whole suite): ``README.md``
and every page under ``docs/``, each block as a test of its own, in order.

- **python** blocks run, one namespace per page, so a page's blocks build on each other;
  top-level ``await`` works (one event loop per page). The namespace starts with
  ``registry`` (a fresh ``worker.Registry``) and ``DATABASE_URL``: a migrated database of
  the test server made for the page, only when the page names ``DATABASE_URL`` (else
  None). ``<!-- skip: next -->`` before a block skips it.
- **sh** blocks are checked, not run: every ``worker`` command in them (a line, a part of
  a pipeline, a ``$(...)``) must name real subcommands and only their options.
- **yaml** and **json** blocks must parse.
- every other block (``text``, ``ini``, ``sql``, ``csv``) is shown, not run;
  ``tests/docs/test_site.py`` fails on a block without a language.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import itertools
import json
import os
import re
import shlex
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml  # type: ignore[import-untyped]
from sybil import Example, Sybil
from sybil.evaluators.python import pad
from sybil.integration.pytest import SybilFile
from sybil.parsers.markdown import CodeBlockParser, SkipParser

from tests.conftest import clone_database, drop_database
from worker import Registry
from worker.cli import cli

cli.loaded()  # the commands load lazily; these tests walk all of them

ROOT = Path(__file__).resolve().parents[2]
LOOP = "__docs_loop__"
_databases = itertools.count()


def documents() -> list[Path]:
    """README.md and every page of the site, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# ---- python: run, with top-level await ----------------------------------------------------


def run_python(example: Example) -> str | None:
    """Run a block in its page's namespace; a failure comes back as its traceback, from
    the block's own line on (Sybil reports the text as the block's failure)."""
    namespace = example.namespace
    source = pad(example.parsed, example.line + example.parsed.line_offset)
    try:
        code = compile(
            source, example.path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
        )
        result = eval(code, namespace)
        if inspect.iscoroutine(result):
            namespace[LOOP].run_until_complete(result)
    except Exception as failed:
        frames = traceback.extract_tb(failed.__traceback__)
        ours = [i for i, frame in enumerate(frames) if frame.filename == example.path]
        shown = traceback.format_list(frames[ours[0] :] if ours else frames)
        return "".join([*shown, *traceback.format_exception_only(failed)])
    finally:
        namespace.pop("__builtins__", None)
    return None


def setup(namespace: dict[str, Any]) -> None:
    namespace["registry"] = Registry()
    namespace[LOOP] = asyncio.new_event_loop()


def teardown(namespace: dict[str, Any]) -> None:
    loop = namespace.pop(LOOP)
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


# ---- sh: every worker command names real subcommands and options ------------------------

_SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")
_OPERATORS = {"|", "||", "&&", ";", "&", "(", ")"}


def worker_commands(block: str) -> Iterator[list[str]]:
    """The argument lists of every ``worker`` command in a shell block."""
    text = block.replace("\\\n", " ")
    for line in text.splitlines():
        parts = [line]
        parts += _SUBSTITUTION.findall(line)
        for part in parts:
            lexer = shlex.shlex(_SUBSTITUTION.sub("X", part), posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            command: list[str] = []
            for token in [*lexer, ";"]:
                if token in _OPERATORS:
                    yield from _worker_argv(command)
                    command = []
                else:
                    command.append(token)


def _worker_argv(tokens: list[str]) -> Iterator[list[str]]:
    words = list(tokens)
    while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]) or words[0] == "exec"):
        words.pop(0)
    if words and Path(words[0]).name == "worker":
        yield [word.strip("[]") for word in words[1:] if word.strip("[]")]


def check_worker_command(argv: list[str]) -> None:
    """Walk the click app along ``argv``: subcommands must exist, options must be the
    command's (or a parent's, before its subcommand)."""
    command: click.Command = cli
    path = ["worker"]
    words = iter(argv)
    for word in words:
        if word.startswith("-") and word != "-":
            name = word.split("=", 1)[0]
            param = _option(command, name)
            if param is None:
                raise AssertionError(f"`{' '.join(path)}` has no option {name}")
            if not (param.is_flag or param.count) and "=" not in word:
                for _ in range(param.nargs):
                    next(words, None)
        elif isinstance(command, click.Group):
            sub = command.commands.get(word)
            if sub is None:
                raise AssertionError(f"`{' '.join(path)}` has no subcommand {word!r}")
            command = sub
            path.append(word)


def _option(command: click.Command, name: str) -> click.Option | None:
    if name in ("-h", "--help"):
        return click.Option(["--help"], is_flag=True)
    for param in command.params:
        if isinstance(param, click.Option) and name in (*param.opts, *param.secondary_opts):
            return param
    return None


# A checker returns what is wrong (Sybil reports the text as the block's failure).


def check_sh(example: Example) -> str | None:
    try:
        for argv in worker_commands(str(example.parsed)):
            check_worker_command(argv)
    except (AssertionError, ValueError) as wrong:
        return str(wrong)
    return None


def check_yaml(example: Example) -> str | None:
    try:
        list(yaml.safe_load_all(str(example.parsed)))
    except yaml.YAMLError as wrong:
        return f"not YAML: {wrong}"
    return None


def check_json(example: Example) -> str | None:
    try:
        json.loads(str(example.parsed))
    except ValueError as wrong:
        return f"not JSON: {wrong}"
    return None


SYBIL = Sybil(
    parsers=[
        CodeBlockParser("python", run_python),
        CodeBlockParser("sh", check_sh),
        CodeBlockParser("yaml", check_yaml),
        CodeBlockParser("json", check_json),
        SkipParser(),
    ],
    path="../..",
    patterns=["README.md", "docs/**/*.md"],
    setup=setup,
    teardown=teardown,
    fixtures=["DATABASE_URL"],
)


_PYTHON_BLOCK = re.compile(r"^\s*```python\n(.*?)^\s*```", re.MULTILINE | re.DOTALL)


def needs_database(page: Path) -> bool:
    """Whether a Python block of the page uses ``DATABASE_URL``."""
    blocks = _PYTHON_BLOCK.findall(page.read_text())
    return any(re.search(r"\bDATABASE_URL\b", block) for block in blocks)


@pytest.fixture(scope="module")
def DATABASE_URL(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """A migrated database for one page (its module is the page), made only when the page
    names it: a page that needs none does not start the test server."""
    if not needs_database(Path(request.node.path)):
        yield None
        return
    admin = request.getfixturevalue("pg_admin_url")
    request.getfixturevalue("template_url")
    name = f"wq_docs_{os.getpid()}_{next(_databases)}"
    url = asyncio.run(clone_database(admin, name))
    try:
        yield url
    finally:
        asyncio.run(drop_database(admin, name))


class Documentation(pytest.File):
    """The pages as one collector, so their examples belong to this directory's tests."""

    def collect(self) -> Iterator[pytest.Item | pytest.Collector]:
        for page in documents():
            yield SybilFile.from_parent(self, path=page, sybils=[SYBIL])


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path == Path(__file__):
        return Documentation.from_parent(parent, path=file_path)
    return None
