"""What every release ships to be checked by the next one: its smoke scenario
(``python -m tests.release.smoke``) and the plays it runs (``tests.release.plays``)."""
