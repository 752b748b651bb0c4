"""What the CLI prints of what a user or a play wrote cannot act on the terminal: one
function escapes it (:func:`worker.output.printable`), and JSON stays JSON."""

from __future__ import annotations

import json

from worker.output import printable, to_json

OSC52 = "\x1b]52;c;cm0gLXJmIH4=\x07"  # set the clipboard
CSI_C1 = "\x9b2J"  # clear the screen through the one-byte CSI
BIDI = "invoice\u202egnp.exe"  # right-to-left override: shows invoiceexe.png


def test_controls_c1_and_bidi_characters_are_escaped_visibly() -> None:
    assert printable(f"play{OSC52}") == "play\\x1b]52;c;cm0gLXJmIH4=\\x07"
    assert printable(CSI_C1) == "\\x9b2J"
    assert printable(BIDI) == "invoice\\u202egnp.exe"
    assert printable("a\u2028b\ud800") == "a\\u2028b\\ud800"
    assert printable("two\nlines\r") == "two\\nlines\\r"  # a value stays on its line
    assert printable("two\nlines\tx", lines=True) == "two\nlines\tx"
    assert printable(f"tb\n{OSC52}", lines=True) == "tb\n\\x1b]52;c;cm0gLXJmIH4=\\x07"


def test_ordinary_text_is_untouched() -> None:
    for text in ("ingest-companies", "café ☕", "👩\u200d💻", "C:\\path", "日本語"):
        assert printable(text) == text
    assert printable(42) == "42"


def test_json_output_is_the_same_value_with_nothing_raw_a_terminal_acts_on() -> None:
    value = {"play": f"p{OSC52}", "org": CSI_C1, "name": BIDI, "ok": "café"}
    text = to_json(value)
    assert json.loads(text) == value
    assert not any(c in text for c in "\x1b\x07\x9b\u202e")
    assert "café" in text  # other non-ASCII stays as it is
