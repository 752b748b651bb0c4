"""Worker "hosts" on one machine: network namespaces, veth links, and a real PgBouncer.

Shared by ``bench.scale`` and the tests that need more than loopback
(``tests/integration/test_pgbouncer.py``, ``tests/e2e/test_host_failure.py``).

- :class:`Hosts`: each host is a network namespace of its own, linked to this (the
  database host's) namespace by a veth pair on a free /30 of :data:`SUBNET`
  (10.231.<n>.1 here, 10.231.<n>.2 in the host). A process started with
  :meth:`Hosts.spawn` runs inside the host and reaches the database only through that
  link, so :meth:`Hosts.cut` (the link
  set down here: carrier lost, nothing refused, packets dropped) cuts it off the way a
  pulled cable or a partition does. Needs root and ``ip``; :func:`namespaces_available`
  says whether they are there.
- Cleanup: every name carries the creating process's pid (``wqh-<pid>-<i>``,
  ``wq<pid>h<i>``), :meth:`Hosts.close` removes what it made, and :func:`sweep` removes
  what a killed earlier run left (its pid is gone). Children get ``PR_SET_PDEATHSIG``, so
  they die with their parent even when it is SIGKILLed.
- :func:`start_pgbouncer`: Debian's ``pgbouncer`` (``apt-get install pgbouncer``) with a
  generated config: one transaction-mode database alias and one session-mode alias per
  upstream database, SCRAM for clients, run as the ``postgres`` user when we are root
  (PgBouncer refuses root).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from psycopg.conninfo import conninfo_to_dict

SUBNET = "10.231"  # each host: a free 10.231.<n>.0/30; never routed off this machine
_LOCK = Path(tempfile.gettempdir()) / "wq-hosts.lock"
MAX_HOSTS = 200
_PR_SET_PDEATHSIG = 1
_NS = re.compile(r"^wqh-(?P<pid>\d+)-\d+$")
_LINK = re.compile(r"^wq(?P<pid>\d+)[hi]\d+$")


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, no veth)."""


def _subnets_in_use() -> set[int]:
    """The third octets of SUBNET that an address on this machine's links already uses."""
    shown = _ip("-4", "-o", "addr", "show", check=False).stdout
    return {int(n) for n in re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", shown)}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent() -> None:
    """``preexec_fn``: SIGKILL this child when the thread that spawned it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def namespaces_available() -> str | None:
    """None when hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_SYS_ADMIN)"
    if shutil.which("ip") is None:
        return "no `ip` command (apt-get install iproute2)"
    probe = f"wqh-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


def sweep() -> list[str]:
    """Delete the namespaces and links of earlier runs whose process is gone."""
    removed: list[str] = []
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return removed
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NS.match(name)
        if match and not _alive(int(match["pid"])):
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        match = _LINK.match(name)
        if match and not _alive(int(match["pid"])):
            _ip("link", "delete", name, check=False)
            removed.append(name)
    return removed


@dataclass
class Host:
    index: int
    namespace: str
    link: str  # our end of the veth pair (in the database host's namespace)
    address: str  # the database host's address on this link
    host_address: str  # the worker host's own address

    def url(self, base_url: str, *, port: int | None = None, dbname: str | None = None) -> str:
        """``base_url`` reached over this host's link (host, and optionally port, dbname)."""
        return rehost(base_url, self.address, port=port, dbname=dbname)


@dataclass
class Hosts:
    """Worker hosts, each a network namespace linked to this one; a context manager that
    removes them (and kills what runs in them) however it is left."""

    count: int
    owner: int = field(default_factory=os.getpid)
    hosts: list[Host] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __enter__(self) -> Hosts:
        reason = namespaces_available()
        if reason is not None:
            raise HostsUnavailable(reason)
        if not 1 <= self.count <= MAX_HOSTS:
            raise ValueError(f"1..{MAX_HOSTS} hosts")
        # Several runs at once (a bench next to the tests) each get /30s of their own:
        # the subnets in use are read and taken under one lock.
        with _LOCK.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            sweep()
            try:
                free = (n for n in range(1, 255) if n not in _subnets_in_use())
                for i in range(1, self.count + 1):
                    self.hosts.append(self._make(i, next(free)))
            except StopIteration:
                self.close()
                raise HostsUnavailable(f"no free /30 left in {SUBNET}.0.0/16") from None
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self, i: int, subnet: int) -> Host:
        ns, outer, inner = f"wqh-{self.owner}-{i}", f"wq{self.owner}h{i}", f"wq{self.owner}i{i}"
        address, host_address = f"{SUBNET}.{subnet}.1", f"{SUBNET}.{subnet}.2"
        _ip("netns", "add", ns)
        host = Host(i, ns, outer, address, host_address)
        self.hosts.append(host)  # removed by close() from here on, whatever fails next
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("addr", "add", f"{address}/30", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{host_address}/30", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        self.hosts.pop()
        return host

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.hosts]

    def spawn(
        self,
        host: Host,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        log: IO[bytes] | int | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``args`` inside ``host`` (it dies with this process)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, *args],
            env=dict(env),
            stdout=log,
            stderr=log,
            cwd=cwd,
            preexec_fn=die_with_parent,  # noqa: PLW1509  # a plain prctl, no locks taken
        )
        self.procs.append(proc)
        return proc

    def cut(self, host: Host) -> None:
        """Pull the host's cable: its link goes down, packets are dropped, nothing refused."""
        _ip("link", "set", host.link, "down")

    def restore(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for host in self.hosts:
            _ip("netns", "delete", host.namespace, check=False)  # takes its veth end along
            _ip("link", "delete", host.link, check=False)
        self.hosts.clear()


def rehost(url: str, host: str, *, port: int | None = None, dbname: str | None = None) -> str:
    """``url`` with another host (and port, dbname), as a postgresql:// URL."""
    params = conninfo_to_dict(url)
    user = quote(str(params.get("user") or ""), safe="")
    password = params.get("password")
    auth = user + (f":{quote(str(password), safe='')}" if password else "") + "@" if user else ""
    return (
        f"postgresql://{auth}{host}:{port or params.get('port') or 5432}/"
        f"{quote(str(dbname or params.get('dbname') or ''), safe='')}"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ---- PgBouncer --------------------------------------------------------------------------


@dataclass
class PgBouncer:
    proc: subprocess.Popen[bytes]
    port: int
    home: Path
    listen: tuple[str, ...]

    def url(self, base_url: str, *, session: bool = False, host: str | None = None) -> str:
        """``base_url`` (its user, password and database) through this PgBouncer: the
        transaction-mode alias, or with ``session`` the session-mode one."""
        dbname = str(conninfo_to_dict(base_url).get("dbname"))
        alias = f"{dbname}_session" if session else dbname
        return rehost(base_url, host or self.listen[0], port=self.port, dbname=alias)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.home / "pgbouncer.log").read_text(errors="replace")
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.home, ignore_errors=True)


def pgbouncer_binary() -> str:
    found = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None
    )
    if found is None:
        raise FileNotFoundError(
            "pgbouncer is not installed: run `bash scripts/install-test-deps`"
        )
    return found


def start_pgbouncer(
    upstream_url: str,
    *,
    users: Mapping[str, str],
    databases: Sequence[str] | None = None,
    listen: Sequence[str] = ("127.0.0.1",),
    port: int | None = None,
    pool_size: int = 20,
    settings: Mapping[str, Any] | None = None,
    timeout_s: float = 15.0,
) -> PgBouncer:
    """Start PgBouncer in front of ``upstream_url``'s server, and wait until it accepts.

    Each database (default: ``upstream_url``'s) gets two aliases: its own name in
    transaction mode, ``<name>_session`` in session mode (for LISTEN). ``users`` maps
    login roles to their passwords (plain text in a 0600 auth file: PgBouncer then speaks
    SCRAM to clients and to the server). ``settings`` adds to or overrides ``[pgbouncer]``.
    """
    up = conninfo_to_dict(upstream_url)
    up_host, up_port = str(up.get("host") or "127.0.0.1"), int(up.get("port") or 5432)
    names = list(databases or [str(up.get("dbname"))])
    home = Path(tempfile.mkdtemp(prefix="wq-pgbouncer-"))
    port = port or free_port(listen[0])
    lines = ["[databases]"]
    for name in names:
        target = f"host={up_host} port={up_port} dbname={name}"
        lines.append(f"{name} = {target} pool_mode=transaction")
        lines.append(f"{name}_session = {target} pool_mode=session")
    options: dict[str, Any] = {
        "listen_addr": ",".join(listen),
        "listen_port": port,
        "unix_socket_dir": "",
        "auth_type": "scram-sha-256",
        "auth_file": home / "userlist.txt",
        "logfile": home / "pgbouncer.log",
        "pidfile": home / "pgbouncer.pid",
        "pool_mode": "transaction",
        "default_pool_size": pool_size,
        "min_pool_size": 0,
        "reserve_pool_size": 0,
        "max_client_conn": 2000,
        "max_db_connections": 0,
        "server_reset_query": "DISCARD ALL",
        "ignore_startup_parameters": "extra_float_digits",
        "log_connections": 0,
        "log_disconnections": 0,
    }
    options.update(settings or {})
    lines.append("[pgbouncer]")
    lines.extend(f"{k} = {v}" for k, v in options.items())
    (home / "pgbouncer.ini").write_text("\n".join(lines) + "\n")
    userlist = home / "userlist.txt"
    userlist.write_text("".join(f'"{u}" "{p}"\n' for u, p in users.items()))
    userlist.chmod(0o600)
    command = [pgbouncer_binary()]
    if os.geteuid() == 0:
        # PgBouncer refuses to run as root: it runs as the user that runs Postgres.
        account = pwd.getpwnam(os.environ.get("WORKER_PG_USER", "postgres"))
        for path in (home, *home.iterdir()):
            os.chown(path, account.pw_uid, account.pw_gid)
        command += ["-u", account.pw_name]
    command.append(str(home / "pgbouncer.ini"))
    proc = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,  # noqa: PLW1509
    )
    bouncer = PgBouncer(proc, port, home, tuple(listen))
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            log = bouncer.log()
            bouncer.stop()
            raise RuntimeError(f"pgbouncer exited with {proc.returncode}:\n{log[-2000:]}")
        try:
            with socket.create_connection((listen[0], port), timeout=0.5):
                return bouncer
        except OSError as exc:
            if time.monotonic() > deadline:
                log = bouncer.log()
                bouncer.stop()
                raise RuntimeError(f"pgbouncer did not listen within {timeout_s}s:\n{log}") from exc
            time.sleep(0.05)


@contextlib.contextmanager
def pgbouncer(upstream_url: str, **kwargs: Any) -> Iterator[PgBouncer]:
    """:func:`start_pgbouncer` as a context manager (stopped and removed on exit)."""
    bouncer = start_pgbouncer(upstream_url, **kwargs)
    try:
        yield bouncer
    finally:
        bouncer.stop()
