"""A file another process polls for (``worker start --ready-file``, the embedded server's
``embedded.json``) is never seen empty or half-written: a reader that opens it as soon as
it exists reads a whole text. (A host-failure test once read the ready file between its
creation and its write and failed on an empty string.)"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

from worker.files import replace_atomically

WRITES = 300
SIGHTED_EVERY = 30  # writes between two that wait for the reader to read


def test_a_reader_polling_for_the_file_only_ever_reads_a_whole_text(tmp_path: Path) -> None:
    path = tmp_path / "ready"
    texts = [json.dumps({"worker_id": f"w{i}", "lanes": ["r-x"] * 200}) for i in range(WRITES)]
    seen: list[str] = []
    read = threading.Condition()
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            with read:
                seen.append(text)
                read.notify_all()

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for n, text in enumerate(texts):
            path.unlink(missing_ok=True)  # a new start: the file appears afresh each time
            replace_atomically(path, text)
            if n % SIGHTED_EVERY == 0:  # the reader keeps reading between the writes
                with read:
                    assert read.wait_for(functools.partial(more_than, seen, len(seen)), 10), n
    finally:
        done.set()
        reader.join()
    assert len(seen) >= WRITES // SIGHTED_EVERY
    assert set(seen) <= set(texts)  # never empty, never a prefix
    assert path.read_text() == texts[-1]
    assert [p.name for p in tmp_path.iterdir()] == ["ready"]  # no temporary left behind


def more_than(seen: list[str], count: int) -> bool:
    return len(seen) > count
