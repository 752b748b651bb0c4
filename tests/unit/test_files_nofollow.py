"""Files in a directory another user owns (the embedded server's data directory, as root):
nothing is written, opened or given an owner through a name that user controls."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from worker import files


def test_place_replaces_a_planted_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    staging, theirs = tmp_path / "ours", tmp_path / "theirs"
    staging.mkdir()
    theirs.mkdir()
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    (theirs / "pg_hba.conf").symlink_to(precious)
    files.place(theirs / "pg_hba.conf", "new\n", staging=staging, mode=0o600)
    assert precious.read_text() == "keep me\n"
    placed = theirs / "pg_hba.conf"
    assert not placed.is_symlink() and placed.read_text() == "new\n"
    assert stat.S_IMODE(placed.stat().st_mode) == 0o600
    assert list(staging.iterdir()) == []  # nothing left behind


def test_place_on_another_file_system_makes_a_fresh_file_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging, theirs = tmp_path / "ours", tmp_path / "theirs"
    staging.mkdir()
    theirs.mkdir()
    rename = os.rename

    def across(src: Any, dst: Any, **kw: Any) -> None:
        if not kw:  # the rename out of the staging directory: another file system
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        rename(src, dst, **kw)

    monkeypatch.setattr(os, "rename", across)
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    (theirs / "postmaster.pid").symlink_to(precious)
    files.place(theirs / "postmaster.pid", "42\n", staging=staging)
    assert precious.read_text() == "keep me\n"
    assert (theirs / "postmaster.pid").read_text() == "42\n"
    assert sorted(p.name for p in theirs.iterdir()) == ["postmaster.pid"]
    assert list(staging.iterdir()) == []


def test_read_regular_refuses_links_fifos_and_foreign_files(tmp_path: Path) -> None:
    plain = tmp_path / "PG_VERSION"
    plain.write_text("16\n")
    assert files.read_regular(plain) == "16\n"
    assert files.read_regular(plain, owner=os.geteuid()) == "16\n"
    assert files.read_regular(plain, owner=os.geteuid() + 1) is None
    link = tmp_path / "link"
    link.symlink_to(plain)
    assert files.read_regular(link) is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert files.read_regular(fifo) is None  # and it did not block waiting for a writer
    os.link(plain, tmp_path / "hard")
    assert files.read_regular(plain, owner=os.geteuid()) is None  # linked elsewhere too
    assert files.read_regular(tmp_path / "missing") is None
    assert files.read_regular(plain, offset=1) == "6\n"


def test_replace_atomically_never_writes_through_a_link(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    ready = tmp_path / "ready"
    ready.symlink_to(precious)
    files.replace_atomically(ready, "{}")
    assert precious.read_text() == "keep me\n"
    assert not ready.is_symlink() and ready.read_text() == "{}"
    files.replace_atomically(tmp_path / "lock", "", mode=0o600)
    assert stat.S_IMODE((tmp_path / "lock").stat().st_mode) == 0o600
