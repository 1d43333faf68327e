"""A Mooncake Store on loopback: ``mooncake_master`` (with its embedded HTTP metadata server) and
one ``mooncake_client`` storage process holding the memory (issue #39).

For the tests, the scale-out benchmark and ``docs/l3.md``'s one-machine recipe: the same two
commands an operator runs, on free loopback ports, stopped (and the master killable and
restartable) from Python. The servers attach with ``--hybrid-l3`` :attr:`LocalMooncake.url`
and give the store no memory of their own, so a server restarted loses nothing of it.
:meth:`LocalMooncake.clear` empties the store between benchmark runs and :meth:`LocalMooncake.usage`
reads what it holds, both from the master (its ``remove_all`` and its ``/metrics``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO, NamedTuple

from .backend import L3Unavailable

HOST = "127.0.0.1"


def free_ports(k: int) -> list[int]:
    """``k`` distinct free loopback ports (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def mooncake_binary(name: str) -> str:
    """``mooncake_master`` / ``mooncake_client`` of the installed wheel (this Python's first)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise L3Unavailable(
            f"{name} is not installed (pip install mooncake-transfer-engine-non-cuda; "
            f"Debian's libibverbs1 too)"
        )
    return found


def mooncake_usable() -> str | None:
    """None when the client imports and the binaries exist; else why not (tests skip on it)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401

        mooncake_binary("mooncake_master")
        mooncake_binary("mooncake_client")
    except (ImportError, OSError, L3Unavailable) as e:
        return f"Mooncake is not usable here: {e}"
    return None


def _wait_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise L3Unavailable(f"exited with {proc.returncode} before listening on {port}")
        try:
            socket.create_connection((HOST, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise L3Unavailable(f"nothing listens on {port} after {timeout_s:.0f} s")


class StoreUsage(NamedTuple):
    objects: int  # keys the master holds
    nbytes: int  # bytes allocated to them in the segments
    evicted: int  # keys the master evicted to make room, since it started


class LocalMooncake:
    """``with LocalMooncake(log_dir) as store: ... store.url ...``"""

    def __init__(self, log_dir: Path, segment_mib: int = 256) -> None:
        self.log_dir = log_dir
        self.segment_mib = segment_mib
        self.rpc, self.http, self.metrics, self.client_port = free_ports(4)
        self.master: subprocess.Popen[bytes] | None = None
        self.storage: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []

    @property
    def metadata(self) -> str:
        return f"http://{HOST}:{self.http}/metadata"

    @property
    def url(self) -> str:
        return f"mooncake://{HOST}:{self.rpc}?metadata={self.metadata}&host={HOST}"

    def _log(self, name: str) -> IO[bytes]:
        f = open(self.log_dir / name, "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(f)
        return f

    def start_master(self) -> None:
        cmd = [
            mooncake_binary("mooncake_master"),
            f"--rpc_port={self.rpc}",
            f"--rpc_address={HOST}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={self.http}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics}",
        ]
        log = self._log("mooncake_master.log")
        self.master = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _wait_port(self.rpc, 30, self.master)
        _wait_port(self.http, 30, self.master)

    def start_storage(self) -> None:
        cmd = [
            mooncake_binary("mooncake_client"),
            f"--host={HOST}",
            f"--global_segment_size={self.segment_mib}MB",
            f"--master_server_address={HOST}:{self.rpc}",
            f"--metadata_server={self.metadata}",
            f"--port={self.client_port}",
            "--protocol=tcp",
        ]
        log = self._log("mooncake_client.log")
        self.storage = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _wait_port(self.client_port, 30, self.storage)

    def master_metrics(self) -> dict[str, float]:
        """The master's unlabelled ``/metrics`` samples (``master_key_count``, ...)."""
        with urllib.request.urlopen(f"http://{HOST}:{self.metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                try:
                    out[name] = float(value)
                except ValueError:
                    continue
        return out

    def usage(self) -> StoreUsage:
        m = self.master_metrics()
        return StoreUsage(
            int(m.get("master_key_count", 0)),
            int(m.get("master_allocated_bytes", 0)),
            int(m.get("master_evicted_key_count", 0)),
        )

    def clear(self, timeout_s: float = 60.0) -> None:
        """Remove every object (a benchmark's next run starts from an empty store).

        The master keeps an object read in the last ``--default_kv_lease_ttl`` (10 s) and
        ``remove_all`` skips it, so this asks again until the master counts no key, and then
        once more a second later (a write that was still in flight)."""
        from .backend import parse_url
        from .mooncake import MooncakeBackend

        backend = MooncakeBackend(parse_url(self.url))
        try:
            end = time.monotonic() + timeout_s
            quiet = 0
            while quiet < 2:
                backend.store.remove_all()
                left = self.usage().objects
                if left:
                    quiet = 0
                    if time.monotonic() > end:
                        raise L3Unavailable(f"{left} objects left in the store after {timeout_s} s")
                else:
                    quiet += 1
                time.sleep(1.0)
        finally:
            backend.close()

    def kill_master(self) -> None:
        """SIGKILL, as a crash: the store's metadata (and so its objects) is gone."""
        if self.master is not None:
            self.master.kill()
            self.master.wait()
            self.master = None

    def __enter__(self) -> LocalMooncake:
        try:
            self.start_master()
            self.start_storage()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for p in (self.storage, self.master):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.storage = self.master = None
        for f in self._logs:
            f.close()
        self._logs.clear()
