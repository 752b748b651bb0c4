"""A failed attempt's error keeps a bounded traceback: the last frames, capped in size."""

from __future__ import annotations

from queues import outcomes


def _recurse(n: int) -> None:
    if n == 0:
        raise ValueError("deep failure")
    _recurse(n - 1)


def _chain(depth: int) -> object:
    """``depth`` distinct functions, each calling the next (no repeated frame to collapse);
    the last raises."""
    code = "def step_0():\n    raise ValueError('deep failure')\n"
    for i in range(1, depth):
        code += f"def step_{i}():\n    step_{i - 1}()\n"
    scope: dict[str, object] = {}
    exec(code, scope)
    return scope[f"step_{depth - 1}"]


def _raised(fn: object, *args: object) -> BaseException:
    try:
        fn(*args)  # type: ignore[operator]
    except Exception as exc:
        return exc
    raise AssertionError("did not raise")


def test_error_of_keeps_the_traceback_with_the_raising_frame() -> None:
    exc = _raised(_recurse, 3)
    error = outcomes.error_of(exc)
    assert error["type"] == "ValueError" and error["message"] == "deep failure"
    stack = error["traceback"]
    assert stack.startswith("Traceback (most recent call last):")
    assert "_recurse" in stack and stack.rstrip().endswith("ValueError: deep failure")


def test_only_the_last_frames_are_kept() -> None:
    exc = _raised(_chain(50))
    stack = outcomes.bounded_traceback(exc, frames=5)
    assert stack is not None
    assert stack.count(", in step_") == 5
    assert "in step_0" in stack and "in step_5" not in stack
    assert "_raised" not in stack  # the outer frames are dropped, the raising ones kept


def test_the_size_is_capped_from_the_end() -> None:
    exc = _raised(_chain(200))
    stack = outcomes.bounded_traceback(exc, frames=200, max_bytes=2048)
    assert stack is not None
    assert len(stack.encode()) <= 2048
    assert stack.startswith("... (traceback truncated")
    assert stack.rstrip().endswith("ValueError: deep failure")


def test_the_default_cap_is_16_kib() -> None:
    exc = _raised(_chain(900))
    error = outcomes.error_of(exc)
    assert len(error["traceback"].encode()) <= outcomes.TRACEBACK_MAX_BYTES == 16 * 1024


def test_a_chained_cause_is_kept() -> None:
    def wrap() -> None:
        try:
            _recurse(1)
        except ValueError as exc:
            raise RuntimeError("enrichment failed") from exc

    stack = outcomes.bounded_traceback(_raised(wrap))
    assert stack is not None
    assert "ValueError: deep failure" in stack and "RuntimeError: enrichment failed" in stack


def test_an_exception_never_raised_has_no_traceback() -> None:
    assert outcomes.bounded_traceback(ValueError("made, not raised")) is None
    assert "traceback" not in outcomes.error_of(ValueError("made, not raised"))
