"""``kvtier serve`` and ``kvtier stats`` (loaded lazily by :mod:`kvtier.cli`)."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import click

from kvtier.errors import ConfigError, KvtierError
from kvtier.units import format_bytes

log = logging.getLogger(__name__)


@click.command("serve")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="kvtier YAML with a server: section (default: $KVTIER_CONFIG or built-in defaults).",
)
@click.option("--host", default=None, help="Override server.host.")
@click.option("--port", type=int, default=None, help="Override server.port (gRPC; 0: any free).")
@click.option(
    "--http-port", type=int, default=None, help="Override server.http_port (0: any free)."
)
@click.option(
    "--data-port",
    type=int,
    default=None,
    help="Override server.data_port (bulk data plane; 0: any free; -1: off).",
)
@click.option(
    "--open/--closed",
    "open_",
    default=None,
    help="Serve requests without a token (default: only on loopback).",
)
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write 'GRPC_PORT HTTP_PORT DATA_PORT' here once serving (0: off; for scripts "
    "using port 0).",
)
def serve(
    config_path: str | None,
    host: str | None,
    port: int | None,
    http_port: int | None,
    data_port: int | None,
    open_: bool | None,
    ready_file: str | None,
) -> None:
    """Run the kvtier cache server: gRPC API, /metrics and a live dashboard.

    Stops gracefully on SIGTERM or SIGINT: calls in flight (a block being
    received included) finish within server.shutdown_grace_s, then the store
    flushes its background writes.
    """
    from kvtier.allocator import retain_freed_memory
    from kvtier.server.app import CacheServer
    from kvtier.server.loader import load_server_config

    overrides: dict[str, Any] = {
        k: v
        for k, v in {"host": host, "port": port, "http_port": http_port, "open": open_}.items()
        if v is not None
    }
    if data_port is not None:
        overrides["data_port"] = None if data_port < 0 else data_port
    try:
        server_config, store_config = load_server_config(config_path, overrides=overrides)
        if server_config.malloc_retain is not None:
            retain_freed_memory(server_config.malloc_retain)
        server = CacheServer(server_config, store_config).start()
    except ConfigError as e:
        raise click.ClickException(str(e)) from None

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    tenants = "open (no token needed)" if server_config.is_open else "tokens required"
    click.echo(
        f"kvtier cache server: grpc {server.address} ({tenants}"
        f"{', TLS' if server_config.tls else ''})"
        + (f", data plane :{server.data_port}" if server.data_port else "")
        + (
            f", dashboard http://{server_config.http_host or server_config.host}:{server.http_port}/"
            if server.http_port
            else ""
        )
    )
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(f"{server.port} {server.http_port or 0} {server.data_port or 0}\n")
    while not stop.wait(0.5):
        pass
    click.echo("stopping: finishing calls in flight ...")
    server.stop()
    click.echo("stopped")


def _rate(hits: float, asked: float) -> str:
    return f"{100.0 * hits / asked:5.1f} %" if asked else "    -  "


@click.command("stats")
@click.option("--server", "address", default="127.0.0.1:50051", show_default=True)
@click.option("--token", default=None, help="Bearer token (default: $KVTIER_SERVER_TOKEN).")
@click.option("--tls/--no-tls", default=False, help="Connect with TLS.")
@click.option("--ca-file", type=click.Path(dir_okay=False), default=None, help="PEM roots (TLS).")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds.")
def stats(address: str, token: str | None, tls: bool, ca_file: str | None, timeout: float) -> None:
    """Print a cache server's hit rates, traffic, tier usage and top tenants."""
    import os

    from kvtier.tiers.remote import RemoteTier
    from kvtier.tiers.remote_config import RemoteTierConfig

    token = token or os.environ.get("KVTIER_SERVER_TOKEN") or None
    try:
        config = RemoteTierConfig(
            name="stats",
            address=address,
            token=token,
            tls=tls,
            ca_file=ca_file,
            timeout_s=timeout,
            retries=0,
        )
        tier = RemoteTier(config)
    except (ValueError, ConfigError) as e:
        raise click.ClickException(str(e)) from None
    try:
        health = tier.health()
        s = tier.server_stats()
    except KvtierError as e:
        raise click.ClickException(str(e)) from None
    finally:
        tier.close()
    status = {1: "serving", 2: "draining"}.get(health.status, "unknown")
    click.echo(
        f"kvtier cache server {address} — version {s.version}, {status}, "
        f"up {s.uptime_s:.0f} s, you are {health.tenant or '(no tenant)'} ({health.role or '-'})"
        + (f", data plane :{health.data_port}" if health.data_port else "")
    )
    click.echo(
        f"lookup hit rate {_rate(s.lookup_hits, s.lookup_keys)} "
        f"({s.lookup_hits}/{s.lookup_keys} keys)   "
        f"get hit rate {_rate(s.get_hits, s.get_keys)} ({s.get_hits}/{s.get_keys} keys)"
    )
    click.echo(
        f"bytes in {format_bytes(s.bytes_in)}  out {format_bytes(s.bytes_out)}   "
        f"requests {s.requests}  errors {s.errors}"
    )
    if s.HasField("recent"):
        r = s.recent
        lhr = "-" if r.lookup_hit_rate < 0 else f"{100 * r.lookup_hit_rate:.1f} %"
        ghr = "-" if r.get_hit_rate < 0 else f"{100 * r.get_hit_rate:.1f} %"
        click.echo(
            f"last {r.window_s:.0f} s: lookup hit rate {lhr}, get hit rate {ghr}, "
            f"in {format_bytes(int(r.bytes_in_per_s))}/s, out {format_bytes(int(r.bytes_out_per_s))}/s, "
            f"{r.requests_per_s:.1f} req/s"
        )
    click.echo("")
    click.echo(
        f"{'tier':<12} {'used':>10} {'capacity':>10} {'blocks':>8} {'get hit':>8} "
        f"{'lookup hit':>10} {'evictions':>9} {'errors':>6}"
    )
    for t in s.tiers:
        cap = format_bytes(t.capacity_bytes) if t.capacity_bytes else "-"
        click.echo(
            f"{t.name:<12} {format_bytes(t.used_bytes):>10} {cap:>10} {t.blocks:>8} "
            f"{_rate(t.get_hits, t.get_hits + t.get_misses):>8} "
            f"{_rate(t.contains_hits, t.contains_hits + t.contains_misses):>10} "
            f"{t.evictions:>9} {t.errors:>6}"
        )
    if s.tenants:
        click.echo("")
        click.echo(
            f"{'tenant':<20} {'requests':>9} {'errors':>7} {'in':>10} {'out':>10} "
            f"{'lookup hit':>10} {'get hit':>8}"
        )
        for tn in sorted(s.tenants, key=lambda t: -(t.bytes_in + t.bytes_out))[:10]:
            click.echo(
                f"{tn.name:<20} {tn.requests:>9} {tn.errors:>7} {format_bytes(tn.bytes_in):>10} "
                f"{format_bytes(tn.bytes_out):>10} {_rate(tn.lookup_hits, tn.lookup_keys):>10} "
                f"{_rate(tn.get_hits, tn.get_keys):>8}"
            )
