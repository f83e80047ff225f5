"""``kvtier serve`` as a process (graceful SIGTERM), ``kvtier stats``, a client killed mid-stream,
and loading the server configuration."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.block import verify_block
from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.provenance import unstamped, writer_of
from kvtier.server.loader import SERVER_DISK_DIR, load_server_config
from kvtier.server.tenants import scope_key, tenant_salt
from kvtier.tiers.disk import DiskTier
from kvtier.wire import kvtier_cache_pb2 as pb
from tests.server.helpers import (
    TOKENS,
    auth,
    block,
    key,
    metric,
    remote,
    running_server,
    server_config,
    sha256,
    stub,
)

REPO = Path(__file__).resolve().parents[2]
KVTIER = [sys.executable, "-m", "kvtier.cli"]


def _config_file(tmp: Path) -> Path:
    path = tmp / "kvtier.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            tiers:
              - type: cpu
                capacity: 64MiB
              - type: disk
                path: {tmp / "disk"}
                capacity: 256MiB
            server:
              host: 127.0.0.1
              port: 0
              http_port: 0
              threads: 4
              shutdown_grace_s: 20
              open: false
              tenants:
                - name: alpha
                  token_sha256: {sha256(TOKENS["alpha"])}
                - name: ops
                  token_sha256: [{sha256(TOKENS["ops"])}]
                  role: admin
            """
        )
    )
    return path


def _start_serve(tmp: Path) -> tuple[subprocess.Popen[str], str, int]:
    ready = tmp / "ready"
    proc = subprocess.Popen(
        [*KVTIER, "serve", "--config", str(_config_file(tmp)), "--ready-file", str(ready)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists() or not ready.read_text().endswith("\n"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"kvtier serve did not start: {proc.communicate()[0]}")
        time.sleep(0.05)
    try:
        grpc_port, http_port, data_port = (int(p) for p in ready.read_text().split())
        assert data_port > 0, "the data plane is on by default"
    except BaseException:
        proc.kill()  # never leave a server behind a failed start
        proc.wait()
        raise
    return proc, f"127.0.0.1:{grpc_port}", http_port


def _inflight(http_port: int) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvtier_server_inflight_requests "):
                return float(line.split()[1])
    return 0.0


def test_serve_finishes_a_put_in_flight_on_sigterm_and_flushes_to_disk(tmp_path: Path) -> None:
    proc, address, http_port = _start_serve(tmp_path)
    try:
        channel, s = stub(address)
        data = block(3, tokens=4000)
        k = key(3)
        frames = [pb.PutFrame(key=k, size=len(data), data=data[:100_000])]
        frames += [
            pb.PutFrame(data=data[o : o + 100_000]) for o in range(100_000, len(data), 100_000)
        ]
        half_sent = threading.Event()
        go_on = threading.Event()

        def slow() -> Iterator[pb.PutBatch]:
            yield pb.PutBatch(frames=frames[:1])
            half_sent.set()
            go_on.wait(20)
            yield pb.PutBatch(frames=frames[1:])

        future = s.Put.future(slow(), metadata=auth(TOKENS["alpha"]), timeout=30)
        assert half_sent.wait(10)
        deadline = time.monotonic() + 10
        while _inflight(http_port) < 1:  # the server is inside the Put call
            assert time.monotonic() < deadline, "the Put never reached the server"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the server is draining now
        assert proc.poll() is None, "the server quit with a call in flight"
        go_on.set()
        assert future.result(timeout=20).blocks == 1
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "stopping" in out and "stopped" in out
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the block reached the disk tier before the process exited
    disk = DiskTier(tmp_path / "disk", 256 << 20)
    scoped = scope_key(tenant_salt("alpha"), k)
    (got,) = disk.get([scoped])
    assert got is not None and bytes(unstamped(got)) == data
    assert writer_of(got) == "alpha"  # stored stamped with its writer
    verify_block(got)
    disk.close()


def test_stats_command_prints_hit_rates_tiers_and_tenants(tmp_path: Path) -> None:
    proc, address, http_port = _start_serve(tmp_path)
    try:
        tier = remote(address, token=TOKENS["alpha"])
        tier.put([(key(i), block(i)) for i in range(4)])
        assert tier.prefix_length([key(i) for i in range(8)]) == 4
        assert tier.get([key(0), key(9)])[0] == block(0)
        tier.close()
        runner = CliRunner()
        result = runner.invoke(main, ["stats", "--server", address, "--token", TOKENS["ops"]])
        assert result.exit_code == 0, result.output
        out = result.output
        assert "you are ops (admin), data plane :" in out
        assert "lookup hit rate  50.0 % (4/8 keys)" in out
        assert "get hit rate  50.0 % (1/2 keys)" in out
        assert "cpu" in out and "disk" in out
        assert "alpha" in out  # the admin sees the tenants table
        denied = runner.invoke(main, ["stats", "--server", address, "--token", "wrong"])
        assert denied.exit_code != 0 and "UNAUTHENTICATED" in denied.output
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=5) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


_KILLED_CLIENT = """
import sys, time
import grpc
from kvtier.wire import kvtier_cache_pb2 as pb, kvtier_cache_pb2_grpc as pbg
address, key_hex, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
data = bytes(size)
def frames():
    yield pb.PutBatch(frames=[pb.PutFrame(key=bytes.fromhex(key_hex), size=size, data=data[: size // 2])])
    print("half", flush=True)
    time.sleep(60)
    yield pb.PutBatch(frames=[pb.PutFrame(data=data[size // 2 :])])
pbg.KvCacheStub(grpc.insecure_channel(address)).Put(frames())
"""


def test_a_client_killed_mid_stream_leaves_no_partial_block() -> None:
    with running_server(server_config(http_port=None)) as server:
        k = key(77)
        before = metric(server, "kvtier_server_incomplete_puts_total")
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _KILLED_CLIENT,
                server.address,
                k.hex(),
                str(len(block(77, 2000))),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "half"
            deadline = time.monotonic() + 10
            while server.service.put_budget.used == 0:  # the server holds the half block
                assert time.monotonic() < deadline, "the Put never reached the server"
                time.sleep(0.02)
        finally:
            child.kill()
            child.wait()
        deadline = time.monotonic() + 10
        while metric(server, "kvtier_server_incomplete_puts_total") == before:
            assert time.monotonic() < deadline, "the server never noticed the dead client"
            time.sleep(0.05)
        tier = remote(server)
        assert tier.contains([k]) == [False]
        assert tier.get([k]) == [None]
        assert server.service.put_budget.used == 0
        # still serving
        assert tier.put([(k, block(77, 2000))]) == [True]
        assert tier.get([k]) == [block(77, 2000)]
        tier.close()


def test_load_server_config_splits_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _config_file(tmp_path)
    server, store = load_server_config(path, env={"KVTIER_CHUNK_SIZE": "512"})
    assert server.threads == 4 and not server.is_open
    assert [t.name for t in server.tenants] == ["alpha", "ops"]
    assert [t.type for t in store.tiers] == ["cpu", "disk"]
    assert store.chunk_size == 512  # environment over file
    server2, _ = load_server_config(path, env={}, overrides={"port": 1234, "open": True})
    assert server2.port == 1234 and server2.is_open


def test_server_defaults_keep_the_disk_tier_apart_from_engines(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text("server:\n  port: 7000\n")
    server, store = load_server_config(path, env={})
    assert server.port == 7000 and server.is_open  # loopback by default
    assert Path(store.tiers[1].path) == SERVER_DISK_DIR  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("yaml_text", "words"),
    [
        ("server:\n  prot: 1\n", "server.prot: unknown key"),
        ("server:\n  tenants: [{name: a, token_sha256: plaintoken}]\n", "64 lowercase hex"),
        ("server:\n  tenants: [{name: anonymous, token_sha256: " + "a" * 64 + "}]\n", "reserved"),
        ("server:\n  chunk_size: 8MiB\n", "must fit in max_message_size"),
        ("server: 3\n", "server: Input should be a valid dictionary"),
        ("chunk_size: 7\nserver: {}\n", "chunk_size"),
    ],
)
def test_bad_server_config_names_the_key(tmp_path: Path, yaml_text: str, words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as e:
        load_server_config(path, env={})
    assert words in str(e.value)
    assert str(path) in str(e.value)


def test_serve_refuses_a_bad_config_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("server:\n  threads: 0\n")
    result = CliRunner().invoke(main, ["serve", "--config", str(path)])
    assert result.exit_code != 0
    assert "server.threads" in result.output


def test_loader_uses_an_integrated_server_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once KvtierConfig has a ``server`` field, the whole file goes through load_config."""
    import yaml

    import kvtier.server.loader as loader
    from kvtier.config import KvtierConfig
    from kvtier.server_config import ServerConfig

    class WithServer(KvtierConfig):
        server: ServerConfig = ServerConfig()

    def fake_load_config(path, *, env=None, overrides=None):
        data = yaml.safe_load(Path(path).read_text())
        data.update(overrides or {})
        return WithServer.model_validate(data)

    monkeypatch.setattr(loader, "KvtierConfig", WithServer)
    monkeypatch.setattr(loader, "load_config", fake_load_config)
    path = tmp_path / "k.yaml"
    path.write_text("server:\n  port: 7001\n  threads: 3\n")
    server, store = load_server_config(path, env={}, overrides={"threads": 5})
    assert (server.port, server.threads) == (7001, 5)
    assert isinstance(store, WithServer)
    assert Path(store.tiers[1].path) == SERVER_DISK_DIR  # type: ignore[union-attr]
