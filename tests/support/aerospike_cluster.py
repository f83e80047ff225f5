"""A real Aerospike CE cluster on 127.0.0.1 for tests and benchmarks, from ``../shared/aerospike``.

``../shared/aerospike`` (beside the repository, when a machine provides it)
holds a prebuilt ``asd`` and the scripts that run it: ``start.sh`` starts N
nodes and waits until they form one cluster, ``start-node.sh`` restarts one
node and waits until it rejoined and migrations are done, ``stop.sh`` stops
them. :class:`AerospikeCluster` drives those scripts and adds what failure
tests need: SIGKILL, SIGSTOP and SIGCONT of one node, waiting for a cluster
size, and putting every node back (:meth:`AerospikeCluster.heal`).

The namespace is configured exactly as ``deploy/aerospike/aerospike.conf``
(the file docker-compose runs): :func:`deploy_settings` reads it; the
settings ``start.sh`` takes are passed to it, every other namespace setting
and the service settings it does not write are applied with ``set-config``
on every node (again after a restart).
``tests/kvtier/test_aerospike_cluster.py`` checks that each setting of the
file is what every node reports.

The nodes run detached (their own session): :meth:`AerospikeCluster.stop`
must run, and a watchdog process started with the cluster stops the nodes
should the process that started them die without doing so.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "aerospike"
"""Where a machine provides the real server: ``../shared/aerospike`` from the repository root."""
DEPLOY_CONF = REPO / "deploy" / "aerospike" / "aerospike.conf"

# start.sh options that carry a namespace setting of the conf, by setting name.
_START_OPTIONS = {
    "replication-factor": "--replication-factor",
    "max-record-size": "--max-record-size",
    "nsup-period": "--nsup-period",
    "storage-engine.data-size": "--data-size",
}
# Service settings start.sh writes itself (proto-fd-max: to fit the open-files limit).
_START_SERVICE = ("cluster-name", "proto-fd-max", "node-id", "work-directory")
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}

# Stops the nodes of a run dir once the process that started them is gone.
_WATCHDOG = """
import os, shutil, subprocess, sys, time
parent, stop, run_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
while True:
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        break
    time.sleep(1)
subprocess.run([stop, run_dir, "--timeout", "5"], capture_output=True)
shutil.rmtree(run_dir, ignore_errors=True)
"""


def available() -> bool:
    """Whether this machine provides the real server (``../shared/aerospike/start.sh``)."""
    return (SHARED / "start.sh").is_file() and (SHARED / "bin" / "asd").is_file()


def to_bytes(value: str) -> int:
    """``1M`` / ``2G`` / ``512K`` / ``4096`` (aerospike.conf sizes) in bytes."""
    m = re.fullmatch(r"(\d+)([KMG]?)", value.strip().upper())
    if m is None:
        raise ValueError(f"not a size: {value!r}")
    return int(m.group(1)) * _UNITS.get(m.group(2), 1)


@dataclass(frozen=True)
class DeploySettings:
    """What ``deploy/aerospike/aerospike.conf`` says about the cluster and its namespace.

    Attributes:
        cluster_name: ``service.cluster-name``.
        hb_interval_ms, hb_timeout: ``network.heartbeat`` interval and missed beats.
        namespace: The namespace's name.
        settings: Every namespace setting as the server's ``namespace/<ns>``
            info names it (``storage-engine.`` prefix for the storage
            section), value as written in the file.
        service: The service settings start.sh does not write itself
            (``get-config:context=service`` names them so).
    """

    cluster_name: str
    hb_interval_ms: int
    hb_timeout: int
    namespace: str
    settings: dict[str, str] = field(default_factory=dict)
    service: dict[str, str] = field(default_factory=dict)

    def expected_info(self) -> dict[str, str]:
        """Each setting as ``namespace/<ns>`` reports it (sizes in bytes)."""
        out = {}
        for key, value in self.settings.items():
            is_size = key in ("max-record-size", "storage-engine.data-size")
            out[key] = str(to_bytes(value)) if is_size else value
        return out


def deploy_settings(path: Path = DEPLOY_CONF) -> DeploySettings:
    """Parse the service, heartbeat and (single) namespace sections of an aerospike.conf."""
    stack: list[str] = []
    values: dict[str, str] = {}
    namespace = ""
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.endswith("{"):
            words = line[:-1].split()
            if words[0] == "namespace":
                namespace = words[1]
                stack.append("namespace")
            elif words[0] == "storage-engine":
                values["namespace.storage-engine"] = words[1]
                stack.append("storage-engine")
            else:
                stack.append(words[0])
            continue
        if line == "}":
            stack.pop()
            continue
        key, _, value = line.partition(" ")
        values[".".join([*stack, key])] = value.strip()
    settings = {
        k.removeprefix("namespace."): v for k, v in values.items() if k.startswith("namespace.")
    }
    service = {
        k.removeprefix("service."): v
        for k, v in values.items()
        if k.startswith("service.") and k.removeprefix("service.") not in _START_SERVICE
    }
    return DeploySettings(
        cluster_name=values["service.cluster-name"],
        hb_interval_ms=int(values["network.heartbeat.interval"]),
        hb_timeout=int(values["network.heartbeat.timeout"]),
        namespace=namespace,
        settings=settings,
        service=service,
    )


def info(port: int, command: str, timeout: float = 2.0) -> str:
    """One info command to the node on ``127.0.0.1:port``; its value (the info protocol)."""
    payload = (command + "\n").encode()
    header = struct.pack(">Q", (2 << 56) | (1 << 48) | len(payload))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(header + payload)
        size = struct.unpack(">Q", _recv_exact(s, 8))[0] & ((1 << 48) - 1)
        body = _recv_exact(s, size).decode(errors="replace")
    _, _, value = body.partition("\t")
    return value.strip()


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the node")
        buf += chunk
    return bytes(buf)


def parse_pairs(text: str, sep: str = ";") -> dict[str, str]:
    """``a=1;b=2`` into a dict."""
    return dict(p.split("=", 1) for p in text.strip().strip(sep).split(sep) if "=" in p)


class ClusterError(RuntimeError):
    """A script of ``../shared/aerospike`` failed; the message carries its output."""


class AerospikeCluster:
    """``nodes`` real ``asd`` processes on 127.0.0.1 forming one cluster, configured as deployed.

    Args:
        nodes: How many nodes.
        settings: The namespace and cluster settings (default: the deploy conf's).
        overrides: Namespace settings to change from ``settings`` (a benchmark's
            larger ``storage-engine.data-size``, say).
        run_dir: Where the nodes keep configs, logs and pid files (default: a new temp dir).
    """

    def __init__(
        self,
        nodes: int = 2,
        settings: DeploySettings | None = None,
        *,
        overrides: dict[str, str] | None = None,
        run_dir: Path | None = None,
    ) -> None:
        base = settings or deploy_settings()
        self.settings = DeploySettings(
            base.cluster_name,
            base.hb_interval_ms,
            base.hb_timeout,
            base.namespace,
            {**base.settings, **(overrides or {})},
            base.service,
        )
        self.nodes = nodes
        self.namespace = self.settings.namespace
        self.run_dir = run_dir or Path(tempfile.mkdtemp(prefix="kvtier-aerospike-"))
        self.ports: list[int] = []
        self.build = ""
        self._watchdog: subprocess.Popen[bytes] | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self, attempts: int = 6) -> AerospikeCluster:
        """Start the nodes on free ports (retried on a port taken meanwhile); apply the settings.

        Raises:
            ClusterError: start.sh failed (its stderr, with the nodes' log tails, in the message).
        """
        args = [
            "--nodes", str(self.nodes), "--dir", str(self.run_dir),
            "--namespace", self.namespace, "--cluster-name", self.settings.cluster_name,
            "--hb-interval", str(self.settings.hb_interval_ms),
            "--hb-timeout", str(self.settings.hb_timeout),
        ]  # fmt: skip
        for key, option in _START_OPTIONS.items():
            if key in self.settings.settings:
                args += [option, self.settings.settings[key]]
        rng = random.Random()
        for _ in range(attempts):
            # Below Linux's ephemeral range (32768-60999), so no client socket holds a port.
            base = rng.randrange(12000, 32000 - 10 * self.nodes, 10)
            proc = subprocess.run(
                [str(SHARED / "start.sh"), *args, "--base-port", str(base)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if proc.returncode == 3:  # a port is taken: try another base port
                continue
            if proc.returncode != 0:
                raise ClusterError(f"start.sh exited {proc.returncode}:\n{proc.stderr[-6000:]}")
            self.ports = [base + 10 * i for i in range(self.nodes)]
            break
        else:
            raise ClusterError(f"start.sh found no free ports in {attempts} attempts")
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(SHARED / "stop.sh"),
             str(self.run_dir)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        for i in range(self.nodes):
            self._apply_settings(i)
        self.build = info(self.ports[0], "build")
        return self

    def stop(self) -> None:
        """Stop every node (SIGCONT first, so a paused one can take SIGTERM), then the watchdog."""
        for i in range(len(self.ports)):
            pid = self.pid(i)
            if pid is not None:
                _signal(pid, signal.SIGCONT)
        subprocess.run(
            [str(SHARED / "stop.sh"), str(self.run_dir), "--timeout", "10"],
            capture_output=True,
            timeout=60,
        )
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> AerospikeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- addresses ---------------------------------------------------------------------

    @property
    def seeds(self) -> list[str]:
        """``127.0.0.1:port`` of every node."""
        return [f"127.0.0.1:{p}" for p in self.ports]

    @property
    def address(self) -> str:
        """The first node's ``host:port`` (one seed is enough for a client)."""
        return self.seeds[0]

    def describe(self) -> str:
        rf = int(self.settings.settings.get("replication-factor", "1"))
        effective = f" (effective {self.nodes})" if rf > self.nodes else ""
        return (
            f"Aerospike Community Edition {self.build}, {self.nodes} node(s) on 127.0.0.1, "
            f"namespace {self.namespace} replication-factor {rf}{effective}"
        )

    # -- nodes ---------------------------------------------------------------------------

    def pid(self, i: int) -> int | None:
        """The live asd process of node ``i``, or ``None``."""
        try:
            pid = int((self.run_dir / f"node{i}" / "asd.pid").read_text())
        except (OSError, ValueError):
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return None
        return None if state in ("Z", "X") else pid

    def is_paused(self, i: int) -> bool:
        pid = self.pid(i)
        if pid is None:
            return False
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` and wait until it is gone (its in-memory data dies with it)."""
        pid = self.pid(i)
        assert pid is not None, f"node {i} is not running"
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.pid(i) is not None and time.monotonic() < deadline:
            time.sleep(0.02)

    def pause(self, i: int) -> None:
        """SIGSTOP node ``i``: it holds its sockets and answers nothing."""
        pid = self.pid(i)
        assert pid is not None, f"node {i} is not running"
        os.kill(pid, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        pid = self.pid(i)
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    def restart(self, i: int, *, ignore_migrations: bool = False, timeout: int = 90) -> None:
        """Start node ``i`` again (empty: the namespace is in memory); wait until it rejoined
        and, unless ``ignore_migrations``, migrations finished."""
        cmd = [str(SHARED / "start-node.sh"), str(self.run_dir), str(i), "--timeout", str(timeout)]
        if ignore_migrations:
            cmd.append("--ignore-migrations")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30)
        if proc.returncode != 0:
            raise ClusterError(f"start-node.sh exited {proc.returncode}:\n{proc.stderr[-6000:]}")
        self._apply_settings(i)

    def info(self, i: int, command: str) -> str:
        return info(self.ports[i], command)

    def live(self) -> list[int]:
        """Nodes whose process runs and is not paused."""
        return [i for i in range(self.nodes) if self.pid(i) is not None and not self.is_paused(i)]

    def cluster_size(self, i: int) -> int:
        return int(parse_pairs(self.info(i, "statistics"))["cluster_size"])

    def wait_stable(
        self, size: int | None = None, *, migrations: bool = True, timeout: float = 90
    ) -> float:
        """Wait until every live node reports one stable cluster of ``size`` (default: the live
        nodes) with migrations done (unless ``migrations`` is false); the seconds it took."""
        start = time.monotonic()
        while True:
            nodes = self.live()
            want = len(nodes) if size is None else size
            command = f"cluster-stable:size={want};ignore-migrations={str(not migrations).lower()}"
            try:
                keys = {self.info(i, command) for i in nodes}
            except OSError:
                keys = {"ERROR"}
            if len(keys) == 1 and not next(iter(keys)).startswith("ERROR"):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise ClusterError(f"cluster not stable at size {want} after {timeout}s: {keys}")
            time.sleep(0.1)

    def heal(self) -> None:
        """Every node running again, one stable cluster, migrations done (a test's finalizer)."""
        for i in range(self.nodes):
            if self.is_paused(i):
                self.resume(i)
        for i in range(self.nodes):
            if self.pid(i) is None:
                self.restart(i)
        self.wait_stable(self.nodes)

    def namespace_info(self, i: int) -> dict[str, str]:
        return parse_pairs(self.info(i, f"namespace/{self.namespace}"))

    # -- settings ------------------------------------------------------------------------

    def service_config(self, i: int) -> dict[str, str]:
        return parse_pairs(self.info(i, "get-config:context=service"))

    def _apply_settings(self, i: int) -> None:
        """``set-config`` of every setting start.sh does not take, on node ``i``."""
        for name, value in self.settings.service.items():
            reply = self.info(i, f"set-config:context=service;{name}={value}")
            if reply != "ok":
                raise ClusterError(f"node {i}: set-config service {name}={value}: {reply}")
        for key, value in self.settings.settings.items():
            if key in _START_OPTIONS or key == "storage-engine":
                continue
            name = key.removeprefix("storage-engine.")
            reply = self.info(i, f"set-config:context=namespace;id={self.namespace};{name}={value}")
            if reply != "ok":
                raise ClusterError(f"node {i}: set-config {name}={value}: {reply}")


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
