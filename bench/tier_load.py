"""Predictability under load: fleet tiers' get/put latency from 1 to 64 concurrent clients.

    python -m bench.tier_load --quick --tiers aerospike,server,redis --concurrency 1,8,32
    python -m bench.tier_load                       # 1,2,4,8,16,32,64 clients, more samples

Stores, each driven by N clients at once. Each client is a process of its
own with its own store client, as N engine processes of a fleet are
(bench/tier_load_workers.py); with ``--threads`` they are N threads of this
process sharing one store client, and then wait on each other's GIL more
than on the store.

* ``aerospike-raw`` and ``aerospike``: a real Aerospike CE server started from
  ``../shared/aerospike`` (tests/support/aerospike_cluster.py: the namespace of
  deploy/aerospike/aerospike.conf, ``max-record-size`` 1 MiB, with a larger
  ``data-size``), first one node, then a 2-node cluster (replication-factor 2).
  ``aerospike-raw`` is the official client alone (bench/tier_load_clients.py:
  the object in segments of the tier's segment size, one batch write, one
  batch read of known keys); ``aerospike`` is kvtier's tier with its default
  settings but for longer timeouts (a timeout here would be an error, not a
  latency). Both use the same client policies.
* ``server``: kvtier's remote tier against a ``kvtier serve`` subprocess
  (CPU storage, bulk data plane; bench/lib/peers.py). Its clients share one
  open tenant, given the server's whole in-flight put budget (1 GiB), as N
  engines with a tenant each would have together (``--server-option``).
* ``redis``: Debian's ``redis-server`` (``apt-get install redis-server``)
  started on a free port, no persistence; redis-py, one connection per client.

Objects: the encoded KV chunk (256 tokens) of SmolLM2-135M (fp32, 11.25 MiB)
and of an 8B-class model (Llama-3-8B shape: 32 layers x 8 KV heads x 128,
bf16, 32 MiB), segmented by the Aerospike stores as the tier segments it.

For each server, object and N: put phases (each call stores a fresh key,
deleted after the timed call), then get phases (each call reads one of 8
stored objects, checked byte for byte after the timed call). The stores of
one server (raw client and tier) take turns call by call in every client,
so they see the same load and the same moments of a host that other work
keeps busy. A row gathers 4 rounds (~1,000 calls with ``--quick``, ~2,500
without): GB/s (bytes over the time spent
inside calls, per client, times N), p50/p99/p99.9 latency of the calls,
p99/p50. With ~1,000 samples p99.9 is the second-largest one. For the
Aerospike tier a row also has ``round_trips_per_call`` and ``own_p50_ms`` /
``own_p99_ms``: each call's time outside its round trips (client calls), i.e.
the tier's own work (splitting, joining, building rows; an xxh3 of blocks that
are not in kvtier's format) — where its time goes.

``node_kill`` (with ``aerospike``): 8 client processes put and get SmolLM2
chunks through the tier (its own timeouts) on the 2-node cluster; node 1 is killed (SIGKILL),
restarted 3 s later, rejoins and migrates, the load runs on 2 s more. Then
every block still acknowledged (its ``put`` answered ``True``; each client
keeps its 3 latest) is read back. ``lost_acknowledged_writes``: those
missing; ``wrong_bytes_returned``: reads, during the run or after, that
returned other bytes than that key's; ``failed_requests``: calls that raised
anything but kvtier's own errors (which the store turns into a recompute or
a dropped save, counted in ``recomputes`` and ``dropped_saves``);
``max_stall_ms``: the longest call.

The last line is one JSON object: ``rows[]``, ``node_kill``, ``bars``
(kvtier's tier within 1.2x of the raw client's p99 at every concurrency, and
the node-kill counts at zero), the machine and its CPU flags. Each ratio
comes with ``p99_ratio_ci90``, the 90 % bootstrap interval of that ratio
from the row's samples alone: with ~1,000 calls a store, p99 is about the
10th-slowest call, and an interval that holds 1.0 is a ratio those samples
cannot tell from equal stores (the bar is still the ratio itself). ``--plot DIR``
writes ``tier-load-latency.png`` there.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from kvtier.bench.lib.common import emit, machine, table, tune_allocator
from kvtier.bench.lib.peers import RedisProcess, ServerProcess
from kvtier.bench.tier_load_clients import CHUNKS, object_block, percentile
from kvtier.bench.tier_load_workers import PhaseResult, Store, ThreadDriver, WorkerPool
from kvtier.tiers.aerospike import AerospikeTier
from kvtier.tiers.aerospike_config import AerospikeTierConfig
from tests.support import aerospike_cluster
from tests.support.aerospike_cluster import AerospikeCluster

MiB = 1024 * 1024
POOL = 8
KILL_CLIENTS = 8
BAR = 1.2
Driver = WorkerPool | ThreadDriver


@dataclass
class Phase:
    """One row's measurements, gathered over its rounds."""

    latencies: list[float] = field(default_factory=list)
    own_s: list[float] = field(
        default_factory=list
    )  # per call: the tier's time outside round trips
    round_trips: int = 0
    busy_s: float = 0.0  # time inside calls, summed over clients
    moved: int = 0  # bytes of the timed calls
    clients: int = 1
    errors: int = 0
    wrong: int = 0

    def add(self, label: str, results: list[dict[str, PhaseResult]]) -> None:
        self.clients = len(results)
        for per_store in results:
            r = per_store[label]
            self.latencies += r.latencies
            self.own_s += r.own_s
            self.round_trips += r.round_trips
            self.busy_s += r.busy_s
            self.moved += r.moved
            self.errors += r.errors
            self.wrong += r.wrong

    def gbps(self) -> float:
        """Bytes per second inside calls, per client, times the clients: the aggregate rate."""
        return self.moved / self.busy_s * self.clients / 1e9 if self.busy_s else 0.0


def cpu_flags() -> dict[str, Any]:
    """The CPU model and the flags that matter for copying and hashing."""
    model, flags = "", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    wanted = ("sse4_2", "avx", "avx2", "avx512f", "avx512bw", "avx512vl", "sha_ni", "aes", "erms")
    return {"model": model, "flags": [f for f in wanted if f in flags]}


def row(tier: str, nodes: int, block: bytes, op: str, clients: int, phase: Phase) -> dict[str, Any]:
    lat = phase.latencies or [float("nan")]
    p50, p99, p999 = (percentile(lat, q) * 1e3 for q in (0.5, 0.99, 0.999))
    return {
        "tier": tier,
        "nodes": nodes,
        "object_mib": round(len(block) / MiB, 2),
        "op": op,
        "clients": clients,
        "samples": len(phase.latencies),
        "gbps": round(phase.gbps(), 3),
        "p50_ms": round(p50, 2),
        "p99_ms": round(p99, 2),
        "p999_ms": round(p999, 2),
        "p99_over_p50": round(p99 / p50, 2) if p50 else None,
        "errors": phase.errors,
        "wrong": phase.wrong,
        **_own(phase),
    }


def _own(phase: Phase) -> dict[str, Any]:
    """For the Aerospike tier: round trips per call, and the p50/p99 of each call's time
    outside its round trips (the tier's own work: checksum, split, join)."""
    if not phase.own_s:
        return {}
    return {
        "round_trips_per_call": round(phase.round_trips / len(phase.own_s), 2),
        "own_p50_ms": round(percentile(phase.own_s, 0.5) * 1e3, 2),
        "own_p99_ms": round(percentile(phase.own_s, 0.99) * 1e3, 2),
    }


def p99_ratio_interval(
    tier: list[float], raw: list[float], seed: int = 0, resamples: int = 1000
) -> tuple[float, float]:
    """The 90 % bootstrap interval of p99(tier) / p99(raw): how far the ratio moves with the
    samples alone (each store's calls resampled with replacement, nearest-rank p99 as in the
    rows). An interval that holds 1.0 is a ratio the samples cannot tell from equal."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def p99s(x: list[float]) -> Any:
        a = np.asarray(x)
        rank = max(1, math.ceil(0.99 * len(a))) - 1
        draws = np.sort(rng.choice(a, size=(resamples, len(a)), replace=True), axis=1)
        return draws[:, rank]

    ratio = p99s(tier) / p99s(raw)
    lo, hi = np.percentile(ratio, [5, 95])
    return float(lo), float(hi)


ROUNDS = 4
"""Each row's samples come from this many rounds (a round's puts are deleted before the next)."""


def ops_for(clients: int, quick: bool) -> int:
    """Timed calls per client and store in one round: ~1,000 (quick) or ~2,500 per row.

    NOTE: ~1,000 with ``--quick`` (it was ~120, then ~400). The slowest calls come in
    bursts (a moment of the host or the server that slows every call in flight), so a
    p99 of 400 samples was set by one or two bursts and by how many of their calls fell
    to each store: two whole runs put one row at 1.10x and 1.94x the raw client's, with
    90 % intervals as wide as 0.77-2.01 for equal p50s."""
    target = 1000 if quick else 2500
    return max(1, round(target / (clients * ROUNDS)))


Spec = Callable[[int], dict[str, Any]]  # object bytes -> a store description for make_client


def measure(
    driver: Driver,
    stores: dict[str, Spec],
    nodes: int,
    blocks: dict[str, bytes],
    concurrency: list[int],
    quick: bool,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Every store of one server at every object size and concurrency, the stores taking
    turns call by call (see the module docstring)."""
    rows = []
    for name, block in blocks.items():
        group: list[Store] = []
        for label, spec in stores.items():
            store: Store = (f"{label}-{nodes}-{name}", spec(len(block)), [])
            keys = [os.urandom(16) for _ in range(POOL)]
            assert all(driver.put(store, keys, name)), f"{label}: could not store the get pool"
            group.append((store[0], store[1], keys))
        labels = dict(zip((s[0] for s in group), stores, strict=True))
        for n in concurrency:
            for op in ("put", "get"):
                phases = {s[0]: Phase() for s in group}
                for _ in range(ROUNDS):
                    results = driver.phase(group, op, n, ops_for(n, quick), name)
                    for tag, phase in phases.items():
                        phase.add(tag, results)
                raw = next((p for t, p in phases.items() if labels[t] == "aerospike-raw"), None)
                for tag, phase in phases.items():
                    r = row(labels[tag], nodes, block, op, n, phase)
                    if labels[tag] == "aerospike" and raw is not None and raw.latencies:
                        lo, hi = p99_ratio_interval(phase.latencies, raw.latencies)
                        r["p99_ratio_ci90"] = [round(lo, 3), round(hi, 3)]
                    rows.append(r)
                    log(
                        f"{r['tier']:14s} nodes {nodes} {name:9s} {op} x{n:<3d} "
                        f"p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  "
                        f"{r['gbps']:.2f} GB/s  errors {r['errors']}"
                        + (
                            f"  round trips/call {r['round_trips_per_call']}  own p50 "
                            f"{r['own_p50_ms']} ms p99 {r['own_p99_ms']} ms"
                            if "own_p50_ms" in r
                            else ""
                        )
                    )
        for store in group:
            driver.delete(store, store[2])
            driver.drop(store[0])
    return rows


def aerospike_config(cluster: AerospikeCluster, set_name: str) -> AerospikeTierConfig:
    return AerospikeTierConfig(
        hosts=cluster.seeds,  # type: ignore[arg-type]
        namespace=cluster.namespace,
        set_name=set_name,
        cluster_name=cluster.settings.cluster_name,
        ttl_s=3600,
        # NOTE: a timeout under 64 clients' load would be an error, not a latency. That
        # includes connecting: a client process that first uses a store at 32 clients
        # connects while 31 others load the host, and with the default 1 s it failed
        # ("Peers not reachable") and skipped its first calls for a breaker cool-down.
        connect_timeout_ms=10_000,
        total_timeout_ms=30_000,
        write_timeout_ms=30_000,
        socket_timeout_ms=10_000,
        max_conns_per_node=256,
    )


def aerospike_stores(cluster: AerospikeCluster, options: dict[str, str]) -> dict[str, Spec]:
    probe = AerospikeTier(aerospike_config(cluster, "raw"))
    segment_size = probe.connect().segment_size
    probe.close()

    def raw(size: int) -> dict[str, Any]:
        config = aerospike_config(cluster, "raw").model_dump(mode="json")
        return {
            "kind": "aerospike-raw",
            "config": config,
            "segment_size": segment_size,
            "object_bytes": size,
        }

    def tier(_size: int) -> dict[str, Any]:
        config = {**aerospike_config(cluster, "load").model_dump(mode="json"), **options}
        return {"kind": "aerospike", "config": config}

    return {"aerospike-raw": raw, "aerospike": tier}


@contextlib.contextmanager
def running(cluster: AerospikeCluster) -> Iterator[AerospikeCluster]:
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def node_kill(
    pool: WorkerPool,
    cluster: AerospikeCluster,
    name: str,
    block_len: int,
    clients: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The load of the module docstring while node 1 is killed, restarted and migrated."""
    config = aerospike_config(cluster, "kill").model_dump(mode="json")
    # the tier's own timeouts (1 s reads, 2 s writes), not the long ones of the load rows
    config.update(total_timeout_ms=1000, write_timeout_ms=2000, socket_timeout_ms=500)
    with tempfile.TemporaryDirectory(prefix="kvtier-kill-") as tmp:
        stop = str(Path(tmp) / "stop")
        t0 = time.time()
        pool.start_kill_load(clients, config, name, t0, stop)
        time.sleep(2.0)
        kill_at = time.time() - t0
        cluster.kill(1)
        log(f"node_kill: node 1 killed at {kill_at:.1f}s")
        time.sleep(3.0)
        restart_at = time.time() - t0
        cluster.restart(1)  # waits for the rejoin and the end of migrations
        back_at = time.time() - t0
        log(f"node_kill: restarted at {restart_at:.1f}s, rejoined and migrated at {back_at:.1f}s")
        time.sleep(2.0)
        Path(stop).touch()
        results = pool.kill_load_results(clients)
        end_at = time.time() - t0

    counts = {k: sum(r.counts[k] for r in results) for k in results[0].counts}
    calls = [c for r in results for c in r.calls]
    live = {k: d for r in results for k, d in r.live.items()}
    tier = AerospikeTier(AerospikeTierConfig.model_validate(config))
    keys = list(live)
    got = tier.get(keys) if keys else []
    lost = sum(g is None for g in got)
    wrong_after = sum(
        g is not None and xxhash.xxh3_128_intdigest(g) != live[k]
        for k, g in zip(keys, got, strict=True)
    )
    tier.delete(keys)
    tier.close()

    def window(a: float, b: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for op in ("get", "put"):
            lat = [d for s, d, o in calls if a <= s < b and o == op]
            out[op] = {"calls": len(lat)}
            if lat:
                out[op].update(
                    p50_ms=round(percentile(lat, 0.5) * 1e3, 1),
                    p99_ms=round(percentile(lat, 0.99) * 1e3, 1),
                    max_ms=round(max(lat) * 1e3, 1),
                )
        return out

    return {
        "tier": "aerospike",
        "nodes": 2,
        "clients": clients,
        "object_mib": round(block_len / MiB, 2),
        "acknowledged": counts["acknowledged"],
        "verified_at_end": len(keys),
        "lost_acknowledged_writes": lost,
        "wrong_bytes_returned": counts["wrong"] + wrong_after,
        "failed_requests": counts["failed"],
        "max_stall_ms": round(max(d for _, d, _ in calls) * 1e3, 1),
        "max_stall_get_ms": round(max((d for _, d, o in calls if o == "get"), default=0) * 1e3, 1),
        "recomputes": counts["recomputes"],
        "dropped_saves": counts["dropped_saves"],
        "puts": counts["puts"],
        "gets": counts["gets"],
        "kill_at_s": round(kill_at, 2),
        "restart_at_s": round(restart_at, 2),
        "rejoined_migrated_at_s": round(back_at, 2),
        "windows": {
            "before_kill": window(0, kill_at),
            "node_down": window(kill_at, restart_at),
            "rejoin_and_migration": window(restart_at, back_at),
            "after": window(back_at, end_at),
        },
    }


def bars(rows: list[dict[str, Any]], kill: dict[str, Any] | None) -> dict[str, Any]:
    """kvtier's Aerospike tier against the raw client, row by row; the node-kill counts."""
    raw = {
        (r["nodes"], r["object_mib"], r["op"], r["clients"]): r
        for r in rows
        if r["tier"] == "aerospike-raw"
    }
    ratios = []
    for r in rows:
        base = raw.get((r["nodes"], r["object_mib"], r["op"], r["clients"]))
        if r["tier"] == "aerospike" and base is not None:
            ratios.append(
                {
                    "nodes": r["nodes"],
                    "object_mib": r["object_mib"],
                    "op": r["op"],
                    "clients": r["clients"],
                    "p99_ratio": round(r["p99_ms"] / base["p99_ms"], 3),
                    "p99_ratio_ci90": r.get("p99_ratio_ci90"),
                }
            )
    out: dict[str, Any] = {"tier_p99_over_raw": ratios}
    if ratios:
        out["tier_within_1_2x_of_raw_p99"] = all(x["p99_ratio"] <= BAR for x in ratios)
    if kill is not None:
        out["node_kill_clean"] = all(
            kill[k] == 0
            for k in ("lost_acknowledged_writes", "wrong_bytes_returned", "failed_requests")
        )
    return out


def plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["object_mib"] for r in rows})
    fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 4 * len(sizes)), squeeze=False)
    series = sorted({(r["tier"], r["nodes"]) for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, size in enumerate(sizes):
        for j, op in enumerate(("get", "put")):
            ax = axes[i][j]
            for k, (tier, nodes) in enumerate(series):
                pts = sorted(
                    (r["clients"], r["p50_ms"], r["p99_ms"])
                    for r in rows
                    if (r["tier"], r["nodes"], r["object_mib"], r["op"]) == (tier, nodes, size, op)
                )
                if not pts:
                    continue
                label = (
                    f"{tier} ({nodes} node{'s' if nodes > 1 else ''})"
                    if tier.startswith("aerospike")
                    else tier
                )
                c = colors[k % len(colors)]
                ax.plot(
                    [p[0] for p in pts], [p[2] for p in pts], "o-", color=c, label=f"{label} p99"
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ":", color=c, alpha=0.7)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel("latency, ms (p99 solid, p50 dotted)")
            ax.set_title(f"{op} of {size:g} MiB objects", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tier-load-latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="~1,000 samples per row instead of ~2,500")
    ap.add_argument("--tiers", default="aerospike,server,redis")
    ap.add_argument("--concurrency", default=None, help="client counts (default 1,2,4,8,16,32,64)")
    ap.add_argument("--objects", default="smollm2,llama3-8b", help=f"of {','.join(CHUNKS)}")
    ap.add_argument("--no-node-kill", action="store_true")
    ap.add_argument("--node-kill-only", action="store_true", help="no load rows, node_kill only")
    ap.add_argument("--nodes", default="1,2", help="Aerospike cluster sizes to measure")
    ap.add_argument(
        "--max-record-size", default=None, help="namespace max-record-size (default: the conf's)"
    )
    ap.add_argument("--replication-factor", type=int, default=None, help="(default: the conf's)")
    ap.add_argument(
        "--tier-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an AerospikeTierConfig setting of the measured tier (e.g. skip_existing=false)",
    )
    ap.add_argument(
        "--server-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a server: setting of `kvtier serve` (e.g. tenant_max_inflight_put_bytes=1GiB)",
    )
    ap.add_argument(
        "--threads",
        action="store_true",
        help="clients as threads of this process (they share its GIL) instead of processes",
    )
    ap.add_argument("--plot", default=None, help="write tier-load-latency.png into this directory")
    args = ap.parse_args()
    tune_allocator()
    concurrency = [int(c) for c in (args.concurrency or "1,2,4,8,16,32,64").split(",")]
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if "redis" in tiers and not RedisProcess.available():  # before the other stores' minutes
        raise SystemExit("redis: redis-server is not on PATH (apt-get install redis-server)")
    options = dict(o.split("=", 1) for o in args.tier_option)
    # NOTE: the clients stand for N engines, each with a tenant of its own in a deployment
    # (deploy/kvtier/kvtier-server.yaml), but reach this open server as one anonymous tenant,
    # which may have only a quarter of the server's put bytes in flight
    # (tenant_max_inflight_put_bytes): 32 puts of 32 MiB at once were refused beyond 256 MiB
    # (55 of 384). N tenants would together have the whole budget.
    server_options = {
        "tenant_max_inflight_put_bytes": "1GiB",  # max_inflight_put_bytes' default
        **dict(o.split("=", 1) for o in args.server_option),
    }
    blocks = {
        name: object_block(CHUNKS[name], seed=i) for i, name in enumerate(args.objects.split(","))
    }

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # NOTE: the client processes are forked first, before this process makes any client.
    workers = max([*concurrency, 0 if args.no_node_kill else KILL_CLIENTS])
    driver: Driver = ThreadDriver(blocks) if args.threads else WorkerPool(workers, blocks)
    rows: list[dict[str, Any]] = []
    kill: dict[str, Any] | None = None
    overrides = {"storage-engine.data-size": "6G"}
    if args.max_record_size:
        overrides["max-record-size"] = args.max_record_size
    if args.replication_factor:
        overrides["replication-factor"] = str(args.replication_factor)
    try:
        if "aerospike" in tiers:
            if not aerospike_cluster.available():
                raise SystemExit(f"aerospike: needs {aerospike_cluster.SHARED} (start.sh, asd)")
            for nodes in (int(n) for n in args.nodes.split(",")):
                with running(AerospikeCluster(nodes, overrides=overrides)) as cluster:
                    log(cluster.describe())
                    if not args.node_kill_only:
                        stores = aerospike_stores(cluster, options)
                        rows += measure(driver, stores, nodes, blocks, concurrency, args.quick, log)
                    if nodes == 2 and not args.no_node_kill:
                        if not isinstance(driver, WorkerPool):
                            raise SystemExit("node_kill runs client processes: drop --threads")
                        name = next(iter(blocks))
                        kill = node_kill(
                            driver, cluster, name, len(blocks[name]), KILL_CLIENTS, log
                        )
                        kill["replication_factor"] = int(
                            cluster.settings.settings["replication-factor"]
                        )
                        log(f"node_kill: {kill}")
        memory = 3 << 30
        if "server" in tiers:
            with ServerProcess(memory, options=server_options) as server:
                spec = {"kind": "server", "address": server.address}
                rows += measure(
                    driver, {"server": lambda _n: spec}, 1, blocks, concurrency, args.quick, log
                )
        if "redis" in tiers:
            with RedisProcess(memory) as redis:
                spec_r = {"kind": "redis", "port": redis.port}
                rows += measure(
                    driver, {"redis": lambda _n: spec_r}, 1, blocks, concurrency, args.quick, log
                )
    finally:
        driver.close()

    headers = [
        "tier",
        "nodes",
        "MiB",
        "op",
        "clients",
        "GB/s",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "p99/p50",
        "err",
    ]
    print(__doc__.split("\n")[0])
    print(table(headers, [
        [r["tier"], r["nodes"], r["object_mib"], r["op"], r["clients"], r["gbps"], r["p50_ms"],
         r["p99_ms"], r["p999_ms"], r["p99_over_p50"], r["errors"] + r["wrong"]] for r in rows
    ]))  # fmt: skip
    summary_bars = bars(rows, kill)
    if summary_bars["tier_p99_over_raw"]:
        print(f"\nThe tier's p99 over the raw client's (bar {BAR}), with the 90 % bootstrap "
              "interval of that ratio from the samples alone:")  # fmt: skip
        print(table(["nodes", "MiB", "op", "clients", "p99 tier/raw", "90 % interval"], [
            [x["nodes"], x["object_mib"], x["op"], x["clients"], x["p99_ratio"],
             "{:.2f}-{:.2f}".format(*x["p99_ratio_ci90"]) if x["p99_ratio_ci90"] else ""]
            for x in summary_bars["tier_p99_over_raw"]
        ]))  # fmt: skip
    if args.plot and rows:
        log(f"plot: {plot(rows, Path(args.plot))}")
    emit(
        {
            "bench": "tier_load",
            "quick": args.quick,
            "machine": {**machine(), "cpu": cpu_flags()},
            "concurrency": concurrency,
            "clients_are": "threads" if args.threads else "processes",
            "tier_options": options,
            "server_options": server_options,
            "namespace_overrides": overrides,
            "rows": rows,
            "node_kill": kill,
            "bars": summary_bars,
        }
    )


if __name__ == "__main__":
    main()
