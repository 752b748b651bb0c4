"""The public API: a small set of names, importable from ``worker``, each documented."""

from __future__ import annotations

import inspect
from pathlib import Path

import worker

ROOT = Path(__file__).resolve().parents[2]


def test_the_public_names_resolve_and_are_documented() -> None:
    assert sorted(worker.__all__) == sorted(worker._EXPORTS)
    for name in worker.__all__:
        value = getattr(worker, name)
        assert inspect.getdoc(value), f"worker.{name} has no docstring"


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        worker.NoSuchThing  # noqa: B018 - the lookup is the test
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("worker.NoSuchThing resolved")


def test_the_packages_ship_type_information_and_a_license() -> None:
    assert (ROOT / "worker" / "py.typed").exists()
    assert (ROOT / "queues" / "py.typed").exists()
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
