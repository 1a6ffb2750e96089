"""Throwaway ``redis-server`` processes for the remote tier's tests and benchmarks.

Every server listens on 127.0.0.1 only, on a port the kernel hands out (never
a fixed one), keeps nothing on disk (``--save "" --appendonly no``) and runs
in its own directory under the test's tmp dir. Readiness is a PING over a raw
socket, so this module needs nothing but the standard library.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

def _which(name: str) -> str | None:
    path = shutil.which(name) or f"/usr/bin/{name}"
    return path if os.access(path, os.X_OK) else None


REDIS_SERVER = _which("redis-server")
REDIS_CLI = _which("redis-cli")
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _resp(*args: bytes | str) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a.encode() if isinstance(a, str) else a
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def command(port: int, *args: bytes | str, timeout: float = 2.0) -> bytes:
    """One command over a fresh socket; the raw reply (enough for PING and INFO-style replies)."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(_resp(*args))
        buf = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if buf.startswith((b"+", b"-", b":")) and buf.endswith(b"\r\n"):
                break
            if buf.startswith(b"$"):
                head, _, rest = buf.partition(b"\r\n")
                n = int(head[1:])
                if n < 0 or len(rest) >= n + 2:
                    break
            if buf.startswith(b"=") or buf.startswith(b"*"):     # not used by these helpers
                break
        return buf


def bulk_text(reply: bytes) -> str:
    head, _, rest = reply.partition(b"\r\n")
    assert head.startswith(b"$"), reply[:80]
    return rest[: int(head[1:])].decode()


class RedisServer:
    """One ``redis-server`` in ``directory``; ``start`` picks a free port unless it has one
    (a restart reuses it)."""

    def __init__(self, directory: Path, *args: str, cluster: bool = False) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.cluster = cluster
        self.port: int | None = None
        self.bus_port: int | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def _argv(self) -> list[str]:
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"), "--daemonize", "no",
                "--protected-mode", "no"]
        if self.cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                     "--cluster-port", str(self.bus_port), "--cluster-node-timeout", "2000"]
        return argv + self.args

    def start(self, timeout: float = 10.0) -> "RedisServer":
        fixed = self.port is not None
        for _ in range(1 if fixed else 5):
            if not fixed:
                self.port = free_port()
                if self.cluster:
                    self.bus_port = free_port()
            self.proc = subprocess.Popen(self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
            if self._wait_ready(timeout):
                return self
            self._reap()
        raise RuntimeError(f"redis-server did not start on port {self.port}: {self.log_tail()}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False                 # exited: most likely the port was taken meanwhile
            try:
                if command(self.port, "PING", timeout=0.5).startswith(b"+PONG"):
                    return True
            except OSError:
                pass
            time.sleep(0.01)
        return False

    def log_tail(self) -> str:
        try:
            return (self.dir / "redis.log").read_text()[-2000:]
        except OSError:
            return "(no log)"

    def _reap(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-use (its keys with it: nothing is persisted)."""
        self._reap()

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections stay open, nothing answers)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def info(self, section: str) -> dict[str, str]:
        out = {}
        for line in bulk_text(command(self.port, "INFO", section)).splitlines():
            if ":" in line and not line.startswith("#"):
                k, _, v = line.partition(":")
                out[k] = v
        return out

    def calls(self, cmd: str) -> int:
        """``INFO commandstats`` calls of one command (0 when it never ran)."""
        entry = self.info("commandstats").get(f"cmdstat_{cmd.lower()}")
        if not entry:
            return 0
        return int(dict(kv.split("=") for kv in entry.split(","))["calls"])

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisClusterProcs:
    """``n`` cluster-enabled masters on loopback, joined with ``redis-cli --cluster create``."""

    def __init__(self, directory: Path, n: int = 3) -> None:
        if REDIS_CLI is None:
            raise RuntimeError("redis-cli is not installed")
        self.nodes = [RedisServer(Path(directory) / f"node{i}", cluster=True) for i in range(n)]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self, timeout: float = 30.0) -> "RedisClusterProcs":
        try:
            for node in self.nodes:
                node.start()
            proc = subprocess.run([REDIS_CLI, "--cluster", "create", *(n.address for n in self.nodes),
                                   "--cluster-replicas", "0", "--cluster-yes"],
                                  capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
            deadline = time.monotonic() + timeout
            while not all(self._ok(n) for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("cluster_state never became ok")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _ok(node: RedisServer) -> bool:
        return "cluster_state:ok" in bulk_text(command(node.port, "CLUSTER", "INFO"))

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "RedisClusterProcs":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
