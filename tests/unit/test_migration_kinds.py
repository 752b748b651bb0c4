"""Every migration says its kind, and the gate refuses a file that does not, or an expand
step that removes or changes something (no database: the files and the rules alone)."""

from __future__ import annotations

import pytest

from queues import migrations
from queues.errors import MigrationFailed

NEXT = migrations.LAST_UNKINDED + 100


def test_every_shipped_migration_has_a_kind_and_the_new_ones_say_it() -> None:
    for m in migrations.code_migrations():
        assert m.kind in migrations.KINDS, m.name
        first = m.sql.split("\n", 1)[0]
        if m.number > migrations.LAST_UNKINDED:
            assert first == f"-- kind: {m.kind}", m.name
        else:
            assert not first.startswith("-- kind:"), f"{m.name} shipped before kinds existed"


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("CREATE TABLE t (id integer);\n", "first line"),
        ("-- kind: sideways\nCREATE TABLE t (id integer);\n", "`-- kind: expand`"),
        ("-- kind:\nCREATE TABLE t (id integer);\n", "`-- kind: expand`"),
    ],
)
def test_a_missing_or_unknown_kind_is_refused_with_the_rule_and_the_fix(
    text: str, rule: str
) -> None:
    with pytest.raises(MigrationFailed) as info:
        migrations.kind_of(f"{NEXT}_x.sql", text, NEXT)
    assert info.value.field == f"sql/migrations/{NEXT}_x.sql"
    assert info.value.rule and rule in (info.value.rule + info.value.message)
    assert info.value.fix and "nothing was applied" in info.value.fix


def test_files_of_the_first_release_keep_their_bytes_and_count_as_expand() -> None:
    text = "CREATE TABLE t (id integer);\n"
    assert migrations.kind_of("0001_x.sql", text, 1) == migrations.EXPAND


@pytest.mark.parametrize(
    "statement",
    [
        "DROP TABLE wq_runs",
        "ALTER TABLE wq_runs DROP COLUMN org",
        "drop function wq_submit(text)",
        "DROP VIEW wq_ledger",
        "ALTER TABLE wq_runs RENAME COLUMN org TO owner",
        "ALTER TABLE wq_runs RENAME TO wq_launches",
        "ALTER TABLE wq_runs ALTER COLUMN org TYPE varchar(10)",
        "ALTER TABLE wq_runs ALTER COLUMN org SET DATA TYPE varchar(10)",
        "ALTER TABLE wq_runs ALTER COLUMN org SET NOT NULL",
    ],
)
def test_an_expand_step_that_removes_or_changes_is_refused(statement: str) -> None:
    text = f"-- kind: expand\n{statement};\n"
    with pytest.raises(MigrationFailed) as info:
        migrations.kind_of(f"{NEXT}_x.sql", text, NEXT)
    assert "removes or changes" in info.value.message
    assert info.value.fix and "contract migration" in info.value.fix
    # The same statement is what a contract step is for.
    contract = f"-- kind: contract\n{statement};\n"
    assert migrations.kind_of(f"{NEXT}_x.sql", contract, NEXT) == migrations.CONTRACT


@pytest.mark.parametrize(
    "statement",
    [
        "ALTER TABLE wq_runs ADD COLUMN note text",
        "CREATE INDEX wq_runs_note_idx ON wq_runs (note)",
        "DROP INDEX IF EXISTS wq_runs_note_idx",
        "DROP TRIGGER IF EXISTS wq_t ON wq_runs",
        "ALTER TABLE wq_runs DROP CONSTRAINT wq_runs_org_check",
        "CREATE FUNCTION wq_submit_v2(p jsonb) RETURNS void LANGUAGE sql AS $$ SELECT $$",
        "-- a comment may say DROP TABLE wq_runs without doing it\nSELECT 1",
    ],
)
def test_an_expand_step_may_add_relax_and_rebuild(statement: str) -> None:
    text = f"-- kind: expand\n{statement};\n"
    assert migrations.kind_of(f"{NEXT}_x.sql", text, NEXT) == migrations.EXPAND


def test_a_releases_trailing_contract_steps_are_not_required_by_its_own_code() -> None:
    def m(number: int, kind: str) -> migrations.Migration:
        return migrations.Migration(f"{number:04d}_m", number, "c", "", kind)

    expand, contract = migrations.EXPAND, migrations.CONTRACT
    assert migrations.schema_of([m(1, expand), m(2, contract)]) == migrations.CodeSchema(2, 1)
    assert migrations.schema_of([m(1, contract), m(2, expand)]) == migrations.CodeSchema(2, 2)
    assert migrations.schema_of([m(1, expand)]) == migrations.CodeSchema(1, 1)
