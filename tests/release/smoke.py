"""The release smoke scenario: admit, run, cancel, crash and recover, stop, all through
the CLI of the release under test.

    WORKER_DATABASE_URL=... python -m tests.release.smoke --release REL [--json]

Run it from the release's source tree (the plays are imported from ``tests/release``
there) with the Python of an environment where that release is installed: the CLI is
the ``worker`` script next to ``sys.executable``. It is shipped with every release, and a
later release's CI runs the previous release's copy of it against a database the later
release migrated, so it uses nothing but that CLI, its own plays
(``tests.release.plays``), the standard library and files in a scratch directory.

It prepares the lane of REL if it has to and sets its policy (a short lease, so a killed
worker's run is rescued in seconds: :data:`POLICY`). Any other worker serving REL must be
busy for the whole scenario, or the crash check fails (it must kill the worker that runs
the run).

The checks, each with a deadline:

1. admit ``steps`` and ``rows`` runs the ordinary way (preparing the lane lazily) and
   admission-only (``WORKER_ADMISSION_ONLY=1``);
2. a worker starts and reports ready, the runs succeed, their results list the steps and
   the rows done, and no step ran twice;
3. a run waiting inside a step is cancelled (``worker cancel``) and ends ``cancelled``;
4. a run's worker is SIGKILLed in its second step; another worker starts, ``worker
   recover --once`` rescues the lapsed lease, the run succeeds on a later attempt, and its
   completed first step did not run again;
5. the worker stops on SIGTERM with exit status 0.

Exit status 0 when every check passed, 1 at the first failed one (the message names it,
with the tail of the worker's log), 2 for bad usage. ``--json`` prints a summary on stdout
either way. Every process it starts is stopped on every way out.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

APP = "tests.release.plays:registry"
# The lane's policy for the scenario: a SIGKILLed worker's lease lapses within 3 s, and a
# rescued run is retried at once.
POLICY = ("--lease-ttl", "3s", "--heartbeat", "0.5s", "--retry-base", "0s")
ROWS = 20
CLI_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 30.0  # a run reaching the state a check waits for
RESCUE_TIMEOUT_S = 20.0  # the lease of a killed worker lapsing and recovery requeueing it
STOP_TIMEOUT_S = 30.0
POLL_S = 0.1
# Variables that would change what the CLI does behind the scenario's back.
SCRUBBED = ("WORKER_ADMISSION_ONLY", "VERCEL", "WORKER_RELEASE", "WORKER_APP")
PR_SET_PDEATHSIG = 1


class CheckFailed(Exception):
    """A check of the scenario failed: ``check`` names it, the message says why."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check


class Stopped(BaseException):
    """The scenario itself got SIGTERM or SIGINT."""


_LIBC: Any = None
with contextlib.suppress(OSError):
    _LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a child only calls prctl


def die_with_parent() -> None:
    """In a worker before it runs (Linux): SIGTERM it when the scenario dies, even by
    SIGKILL (a caller's timeout), so no worker outlives it."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def tail(path: Path, chars: int = 3000) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"({path} is missing)"
    return text[-chars:]


class Scenario:
    def __init__(self, release: str, workdir: Path, source: Path, *, keep: bool) -> None:
        self.release = release
        self.workdir = workdir
        self.keep = keep  # the workdir outlives the scenario
        self.trace = workdir / "trace"
        self.trace.mkdir(parents=True, exist_ok=True)
        self.check = "setup"
        self.started = time.monotonic()
        self.timings: dict[str, float] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}
        self.last_log: Path | None = None
        self.command = [sys.executable, str(Path(sys.executable).parent / "worker")]
        # The plays come from this tree's tests/release, the rest from the installed release:
        # a directory holding only ``tests`` goes first on the path (the tree itself could
        # shadow the installed packages with its uninstalled ones).
        app_path = workdir / "app"
        app_path.mkdir(exist_ok=True)
        link = app_path / "tests"
        if not link.exists():
            link.symlink_to(source / "tests", target_is_directory=True)
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(app_path), os.environ.get("PYTHONPATH", "")) if p
        )
        self.env = env

    # ---- plumbing ----------------------------------------------------------------------

    def fail(self, message: str) -> CheckFailed:
        if self.last_log is not None:
            message += f"\n--- tail of {self.last_log} ---\n{tail(self.last_log)}"
        return CheckFailed(self.check, message)

    @contextlib.contextmanager
    def checking(self, name: str) -> Iterator[None]:
        self.check = name
        began = time.monotonic()
        yield
        self.timings[name] = round(time.monotonic() - began, 2)

    def cli(
        self, *args: str, admission_only: bool = False, ok: Sequence[int] = (0,)
    ) -> subprocess.CompletedProcess[str]:
        env = dict(self.env)
        if admission_only:
            env["WORKER_ADMISSION_ONLY"] = "1"
        shown = "worker " + " ".join(args)
        try:
            done = subprocess.run(
                [*self.command, *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=CLI_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise self.fail(f"`{shown}` did not finish within {CLI_TIMEOUT_S:g} s") from exc
        if done.returncode not in ok:
            raise self.fail(
                f"`{shown}` exited {done.returncode} (expected {'/'.join(map(str, ok))})\n"
                f"stdout: {done.stdout.strip()[-2000:]}\nstderr: {done.stderr.strip()[-2000:]}"
            )
        return done

    def cli_json(self, *args: str, **kw: Any) -> Any:
        done = self.cli(*args, "--json", **kw)
        try:
            return json.loads(done.stdout)
        except ValueError as exc:
            raise self.fail(
                f"`worker {' '.join(args)} --json` printed no JSON: {done.stdout!r}"
            ) from exc

    def submit(
        self, role: str, play: str, params: dict[str, Any], *extra: str, admission_only: bool
    ) -> str:
        data = self.cli_json(
            "submit",
            play,
            "--release",
            self.release,
            "--params",
            json.dumps(params),
            *extra,
            admission_only=admission_only,
        )
        run_id = str(data["run_id"])
        way = "admission_only" if admission_only else "ordinary"
        self.runs[run_id] = {"check": role, "play": play, "admitted": way}
        return run_id

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        ready = self.workdir / f"{name}.ready"
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [
                    *self.command,
                    "start",
                    "--release",
                    self.release,
                    "--app",
                    APP,
                    "--ready-file",
                    str(ready),
                    "--grace",
                    "2s",
                ],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a ^C to the scenario reaches it only through us
                # The scenario runs no threads, so a preexec_fn is safe here.
                preexec_fn=die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
            )
        self.processes.append(proc)
        self.logs[proc.pid] = log
        self.last_log = log
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None:
                raise self.fail(f"worker {name} exited {proc.returncode} before ready")
            if time.monotonic() > deadline:
                raise self.fail(f"worker {name} not ready within {READY_TIMEOUT_S:g} s")
            time.sleep(POLL_S)
        return proc

    def stop_all(self) -> None:
        """SIGTERM every process still running, then SIGKILL what outlives the grace."""
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()

    def show(self, run_id: str) -> dict[str, Any]:
        data: dict[str, Any] = self.cli_json("result", run_id, ok=(0, 1, 3, 5))
        return data

    def until_state(self, run_id: str, want: str, timeout: float = RUN_TIMEOUT_S) -> dict[str, Any]:
        """Wait for the run to end; fail unless it ended ``want``."""
        codes = {"succeeded": 0, "failed": 1, "cancelled": 3}
        done = self.cli(
            "result", run_id, "--wait", "--timeout", f"{timeout:g}s", "--json", ok=(0, 1, 3, 4)
        )
        if done.returncode == 4:
            state = self.show(run_id).get("state")
            raise self.fail(f"run {run_id} still {state} after {timeout:g} s (want {want})")
        data: dict[str, Any] = json.loads(done.stdout)
        if data.get("state") != want or done.returncode != codes[want]:
            raise self.fail(
                f"run {run_id} ended {data.get('state')} (exit {done.returncode}), want {want}; "
                f"error: {json.dumps(data.get('error'))[:1500]}"
            )
        self.runs[run_id]["state"] = want
        self.runs[run_id]["attempt"] = data.get("attempt")
        return data

    def executions(self, run_id: str) -> list[dict[str, Any]]:
        path = self.trace / f"{run_id}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]

    def until_started(self, run_id: str, step: str) -> dict[str, Any]:
        """Wait until a worker began executing ``step`` of the run; its trace line."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            for line in self.executions(run_id):
                if line["step"] == step and line["event"] == "start":
                    return line
            time.sleep(POLL_S)
        state = self.show(run_id).get("state")
        raise self.fail(f"run {run_id} ({state}) never began step {step} in {RUN_TIMEOUT_S:g} s")

    def starts(self, run_id: str) -> Counter[str]:
        return Counter(x["step"] for x in self.executions(run_id) if x["event"] == "start")

    # ---- the scenario ------------------------------------------------------------------

    def run(self) -> None:
        steps = {"count": 3, "trace": str(self.trace)}
        with self.checking("admit"):
            # The first, ordinary submit prepares the lane when it is new.
            ordinary = self.submit("succeed", "steps", steps, admission_only=False)
            self.cli("queues", "set-policy", self.release, *POLICY)
            only = self.submit("succeed", "steps", steps, admission_only=True)
            rows_file = self.workdir / "rows.jsonl"
            rows_file.write_text(
                "".join(json.dumps({"key": f"k{i:03d}", "i": i}) + "\n" for i in range(ROWS))
            )
            rows_input = self.submit(
                "succeed", "rows", {}, "--input", str(rows_file), admission_only=False
            )
            rows_made = self.submit("succeed", "rows", {"count": ROWS}, admission_only=True)

        with self.checking("start"):
            first = self.start_worker("worker-1")

        with self.checking("succeed"):
            for run_id in (ordinary, only):
                result = self.until_state(run_id, "succeeded")["result"]
                if result.get("steps") != ["s0:ok", "s1:ok", "s2:ok"]:
                    raise self.fail(f"run {run_id}: steps {result.get('steps')!r}")
                if result.get("release") != self.release:
                    raise self.fail(f"run {run_id} ran on release {result.get('release')!r}")
                starts = self.starts(run_id)
                if starts != Counter({"s0": 1, "s1": 1, "s2": 1}):
                    raise self.fail(f"run {run_id}: step executions {dict(starts)}")
            for run_id in (rows_input, rows_made):
                data = self.until_state(run_id, "succeeded")
                result = data["result"]
                if (result.get("admitted"), result.get("done")) != (ROWS, ROWS):
                    raise self.fail(f"run {run_id}: rows {result!r}, want {ROWS} done")
                if data.get("rows_done") != ROWS:
                    raise self.fail(f"run {run_id}: rows_done {data.get('rows_done')}")

        with self.checking("cancel"):
            gate = {"count": 1, "gate_at": 0, "gate": "never", **steps}
            waiting = self.submit("cancel", "steps", gate, admission_only=False)
            self.until_started(waiting, "s0")
            self.cli("cancel", waiting, "--reason", "release smoke")
            self.until_state(waiting, "cancelled")

        with self.checking("recover"):
            crash = {"count": 3, "gate_at": 1, "gate": "go", **steps}
            victim = self.submit("recover", "steps", crash, admission_only=False)
            inside = self.until_started(victim, "s1")
            if inside["pid"] != first.pid:
                raise self.fail(
                    f"run {victim} was claimed by a worker this scenario did not start (pid "
                    f"{inside['pid']}, not {first.pid}): another worker serves lane "
                    f"r-{self.release} and has room; run the scenario where it has none"
                )
            first.kill()
            first.wait(timeout=STOP_TIMEOUT_S)
            (self.trace / "go").touch()
            self.start_worker("worker-2")
            rescued = 0
            deadline = time.monotonic() + RESCUE_TIMEOUT_S
            while True:
                report = self.cli_json("recover", "--once")
                rescued += len(report.get("expired") or [])
                data = self.show(victim)
                if data.get("state") != "running" or data.get("lease_owner") != inside["worker"]:
                    break  # the killed attempt is closed
                if time.monotonic() > deadline:
                    raise self.fail(
                        f"run {victim} still leased by the killed worker after "
                        f"{RESCUE_TIMEOUT_S:g} s of `worker recover --once`"
                    )
                time.sleep(0.5)
            data = self.until_state(victim, "succeeded")
            if int(data.get("attempt") or 0) < 2:
                raise self.fail(f"run {victim} succeeded on attempt {data.get('attempt')}")
            if data["result"].get("steps") != ["s0:ok", "s1:ok", "s2:ok"]:
                raise self.fail(f"run {victim}: steps {data['result'].get('steps')!r}")
            starts = self.starts(victim)
            # s0 completed before the kill: it must not run again. s1 was cut off: it runs
            # once more. s2 runs once, after the rescue.
            if starts["s0"] != 1 or starts["s2"] != 1 or starts["s1"] < 2:
                raise self.fail(f"run {victim}: step executions {dict(starts)}")
            self.runs[victim]["rescued_by_recover"] = rescued

        with self.checking("stop"):
            for proc in self.processes:
                if proc.poll() is None:
                    self.last_log = self.logs[proc.pid]
                    proc.send_signal(signal.SIGTERM)
                    try:
                        code = proc.wait(timeout=STOP_TIMEOUT_S)
                    except subprocess.TimeoutExpired as exc:
                        raise self.fail(
                            f"worker pid {proc.pid} still up {STOP_TIMEOUT_S:g} s after SIGTERM"
                        ) from exc
                    if code != 0:
                        raise self.fail(f"worker pid {proc.pid} exited {code} on SIGTERM")

    def summary(self, error: CheckFailed | None) -> dict[str, Any]:
        return {
            "ok": error is None,
            "release": self.release,
            "failed_check": None if error is None else error.check,
            "error": None if error is None else str(error),
            "elapsed_s": round(time.monotonic() - self.started, 2),
            "checks": self.timings,
            "runs": self.runs,
            "workdir": str(self.workdir) if self.keep else None,
        }


def _stop(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.release.smoke", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--release", required=True, help="the release (lane) to run on")
    parser.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the workers' logs and the trace here (default: a temporary directory, "
        "removed afterwards)",
    )
    args = parser.parse_args(argv)
    if not os.environ.get("WORKER_DATABASE_URL"):
        print("smoke: WORKER_DATABASE_URL is not set", file=sys.stderr)
        return 2
    source = Path.cwd()
    if not (source / "tests" / "release" / "plays.py").is_file():
        print(
            f"smoke: run it from a release's source tree ({source} has no tests/release)",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="smoke-")))
        else:
            workdir = args.workdir.resolve()
            workdir.mkdir(parents=True, exist_ok=True)
        scenario = Scenario(args.release, workdir, source, keep=args.workdir is not None)
        error: CheckFailed | None = None
        try:
            scenario.run()
        except CheckFailed as exc:
            error = exc
        except Stopped as exc:
            error = CheckFailed(scenario.check, f"stopped by {exc}")
        except Exception as exc:  # a bug or an answer of a shape it did not expect
            traceback.print_exc()
            error = CheckFailed(scenario.check, f"unexpected {type(exc).__name__}: {exc}")
        finally:
            scenario.stop_all()
        summary = scenario.summary(error)
        if args.json:
            print(json.dumps(summary, indent=2, sort_keys=True))
        if error is not None:
            print(f"smoke: FAILED at {error}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"smoke: ok, release {args.release}, {summary['elapsed_s']} s")
        return 0


if __name__ == "__main__":
    sys.exit(main())
