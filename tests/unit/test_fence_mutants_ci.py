"""What CI runs of the fence mutants (scripts/fence_mutants.py --ci, docs/mutants.md "In
CI"): every mutant when a fenced statement or a mutant changed since the recorded run,
else one share of them, and the shares cover the list."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fm() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fence_mutants", ROOT / "scripts" / "fence_mutants.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fence_mutants"] = module
    spec.loader.exec_module(module)
    return module


def _copy_sql(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "sql" / "queries", tmp_path / "sql" / "queries")
    return tmp_path


def test_the_digest_follows_the_fenced_statements_only(fm: ModuleType, tmp_path: Path) -> None:
    tree = _copy_sql(tmp_path)
    before = fm.fenced_digest(tree, fm.MUTANTS)
    assert before == fm.fenced_digest(ROOT, fm.MUTANTS)

    fenced = fm.MUTANTS[0]
    path = tree / fenced.file
    text = path.read_text(encoding="utf-8")
    named = {m.query for m in fm.MUTANTS if m.file == fenced.file}
    other = next(
        m["name"] for m in fm._HEADER.finditer(text) if m["name"] not in named
    )  # a statement no mutant names, in the same file
    section = fm.statement_text(text, other)
    path.write_text(text.replace(section, section + "-- a comment\n"), encoding="utf-8")
    assert fm.fenced_digest(tree, fm.MUTANTS) == before

    text = path.read_text(encoding="utf-8")
    section = fm.statement_text(text, fenced.query)
    path.write_text(text.replace(section, section + "-- a comment\n"), encoding="utf-8")
    assert fm.fenced_digest(tree, fm.MUTANTS) != before


def test_a_changed_mutation_changes_the_digest_a_longer_test_list_does_not(fm: ModuleType) -> None:
    first = fm.MUTANTS[0]
    changed = fm.Mutant(
        first.id, first.file, first.query, first.removed, first.old, "x", first.tests
    )
    assert fm.fenced_digest(ROOT, fm.MUTANTS) != fm.fenced_digest(ROOT, [changed, *fm.MUTANTS[1:]])
    slower = fm.Mutant(
        first.id, first.file, first.query, first.removed, first.old, first.new, (*first.tests, "x")
    )
    assert fm.fenced_digest(ROOT, fm.MUTANTS) == fm.fenced_digest(ROOT, [slower, *fm.MUTANTS[1:]])


def test_the_shares_cover_every_mutant(fm: ModuleType) -> None:
    shares = [
        [m.id for i, m in enumerate(fm.MUTANTS) if i % fm.CI_SHARES == share]
        for share in range(fm.CI_SHARES)
    ]
    assert sorted(i for share in shares for i in share) == sorted(m.id for m in fm.MUTANTS)
    assert all(shares)
    assert 0 <= fm.ci_share("HEAD") < fm.CI_SHARES


def test_the_doc_records_a_run_it_can_read_back(
    fm: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = tmp_path / "mutants.md"
    doc.write_text(f"# head\n\n{fm.DOC_BEGIN}\nold\n{fm.DOC_END}\n\n## after\n", encoding="utf-8")
    monkeypatch.setattr(fm, "DOC", doc)
    assert fm.recorded_digest() is None
    digest = "ab" * 32
    fm.write_doc("0123456789abcdef", digest, "**2 of 2 killed** in 3 s", "| table |")
    text = doc.read_text(encoding="utf-8")
    assert fm.recorded_digest() == digest
    assert "old" not in text and "| table |" in text and text.endswith("## after\n")
    assert "0123456789ab" in text
