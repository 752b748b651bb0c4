"""A run's row progress for a person: click's in-place bar with rate and ETA on a terminal,
a line per tenth of the way (with the same rate and ETA) when the output is a pipe."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import click

from queues.fields import human_duration


class RowProgress:
    """Shows ``done``/``total`` rows as they change; :meth:`echo` prints a line above it.

    Given ``echo`` (a caller collecting lines), or on a stream that is not a terminal, it
    prints plain lines through it instead of drawing a bar."""

    def __init__(
        self,
        *,
        file: TextIO | None = None,
        echo: Callable[[str], None] | None = None,
        label: str = "rows",
    ) -> None:
        self.file = file or sys.stdout
        self.tty = echo is None and self.file.isatty()
        self._echo = echo
        self.label = label
        self._bar: Any = None
        self._started = time.monotonic()
        self._first_done: int | None = None
        self._last_tenth = -1
        self.done = 0
        self.total = 0

    def rate(self) -> float:
        """Rows per second since the first update."""
        elapsed = time.monotonic() - self._started
        moved = self.done - (self._first_done or 0)
        return moved / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        rate = self.rate()
        return (self.total - self.done) / rate if rate > 0 and self.total > self.done else None

    def _status(self, _item: object = None) -> str:
        return f"{self.rate():,.0f} rows/s"

    def update(self, done: int, total: int) -> None:
        if total <= 0:
            return
        if self._first_done is None:
            self._first_done, self._started = done, time.monotonic()
        self.done, self.total = min(done, total), total
        if not self.tty:
            tenth = self.done * 10 // total
            if tenth != self._last_tenth:
                self._last_tenth = tenth
                eta = self.eta_s()
                left = f", about {human_duration(round(eta))} left" if eta else ""
                self.echo(
                    f"  {self.done}/{total} {self.label} ({tenth * 10}%) at {self._status()}{left}"
                )
            return
        if self._bar is None:
            self._bar = click.progressbar(
                length=total,
                label=f"  {self.label}",
                show_eta=True,
                show_percent=True,
                show_pos=True,
                item_show_func=self._status,
                file=self.file,
            )
            self._bar.__enter__()
        self._bar.length = total
        step = self.done - self._bar.pos
        if step > 0:
            self._bar.update(step)
        else:
            self._bar.render_progress()

    def echo(self, line: str) -> None:
        """A line of output that stays: above the bar on a terminal."""
        if self._echo is not None:
            self._echo(line)
            return
        if self._bar is not None:
            self.file.write("\r\x1b[K")
        click.echo(line, file=self.file)
        if self._bar is not None:
            self._bar.render_progress()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.render_finish()
            self._bar = None
