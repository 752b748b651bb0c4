"""The CHANGELOG is the release record: the package's version has its section, and every
migration after the first release's schema is listed, once, in the section of the release
that brings it (or under Unreleased), with its kind, so an operator reads from it which
release carries a contract step."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from queues import migrations

ROOT = Path(__file__).resolve().parents[2]
HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?$", re.M)
LISTED = re.compile(r"^- `(?P<name>\d{4}_[a-z0-9_]+)` \((?P<kind>expand|contract)\)", re.M)


def sections() -> dict[str, str]:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    found = list(HEADING.finditer(text))
    return {
        m["version"]: text[m.end() : found[i + 1].start() if i + 1 < len(found) else len(text)]
        for i, m in enumerate(found)
    }


def test_the_package_version_has_a_dated_release_section() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), "versions follow SemVer"
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M), (
        f"CHANGELOG.md has no dated section for {version}"
    )
    assert "Unreleased" in sections()


def test_every_migration_is_listed_once_with_its_kind() -> None:
    listed: dict[str, tuple[str, str]] = {}
    for version, body in sections().items():
        for m in LISTED.finditer(body):
            assert m["name"] not in listed, f"{m['name']} is listed twice"
            listed[m["name"]] = (version, m["kind"])
    for migration in migrations.code_migrations():
        if migration.number <= migrations.LAST_UNKINDED:
            continue
        assert migration.name in listed, f"{migration.name} is in no CHANGELOG section"
        assert listed[migration.name][1] == migration.kind, (
            f"{migration.name} is a {migration.kind} step; CHANGELOG.md says "
            f"{listed[migration.name][1]}"
        )
    assert set(listed) <= {m.name for m in migrations.code_migrations()}
