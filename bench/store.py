"""Put/get throughput of kvtier's tiers, each as a ratio to memcpy in the same run.

    python -m bench.store --quick
    python -m bench.store --tiers cpu,disk --sizes 256KiB,1MiB,4MiB,16MiB,32MiB
    python -m bench.store --tiers server --sizes 256KiB,4MiB,32MiB   # + redis if installed
    python -m bench.store --quick --tiers server,server-grpc          # data plane vs gRPC

What is measured, per tier and block size (GB/s of block bytes), with every
copy done by numpy (single-threaded memcpy, like the baseline):

* ``put``: materialise each block from a source buffer (the copy an encoder
  makes) and ``tier.put`` it under a fresh key.
* ``get``: ``tier.get`` and copy each returned block into a destination
  buffer (a CPU-tier get alone returns a reference, which says nothing).
* ``load``: what a consumer pays to receive KV: ``TieredStore.get`` with that
  tier on top, ``decode_block`` (header check; checksum unless the tier
  verified the block already) and the copy of the payload into a destination
  — the figure that matters for time-to-first-token.

Like the ``kvtier`` command line, the benchmark keeps freed memory for reuse
(``kvtier/allocator.py``); peers measured in this process share that setting.
The memcpy baseline copies the same blocks into the same destination with
numpy, measured in the same run right after the tier's figures. Disk figures are with the page cache warm (nothing flushes it
between writing and reading): an upper bound for a real disk.

``server`` is the remote tier talking to a ``kvtier serve`` subprocess over
loopback (CPU-only storage on the server; ``bench/lib/peers.py``), block bytes
over the server's bulk data plane; ``server-grpc`` is the same tier and
server with the data plane off in the client (Get/Put over gRPC). When
``redis-server`` is on PATH, ``redis`` (redis-py + hiredis against a
``redis-server`` started for the run, no persistence) is measured in the same
run with the same blocks, as a peer for ``server``.

``aerospike`` is the Aerospike tier through the official client against
kvtier's *protocol-level test server* (``tests/support/aerospike_server.py``,
pure Python, in this process) with ``max-record-size`` 1 MiB: its figures show
the tier's protocol costs — records, segments, round trips per block — not
what a real Aerospike cluster sustains. Rows are labelled ``aerospike-test``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

from kvtier.bench.lib.common import emit, machine, table, timeit, tune_allocator
from kvtier.bench.lib.peers import RedisProcess, RedisTier, ServerProcess
from kvtier.block import activation_like_kv, decode_block, encode_block
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.units import format_bytes, parse_bytes

BYTES_PER_TOKEN = 2 * 8 * 128 * 2  # one layer, K and V, 8 heads of 128, bf16


def make_blocks(block_bytes: int, count: int, seed: int) -> list[tuple[bytes, bytes]]:
    tokens = max(1, block_bytes // BYTES_PER_TOKEN)
    kv = activation_like_kv((1, 2, tokens, 8, 128), torch.bfloat16, seed=seed)
    out = []
    for i in range(count):
        kv.view(-1)[0] = float(i)  # distinct content per block
        key = (seed * 100003 + i).to_bytes(16, "little")
        out.append((key, encode_block(kv, key=key)))
    return out


def build_tier(kind: str, tmp: Path, capacity: int, peers: dict[str, object]) -> Tier:
    if kind == "cpu":
        return CpuTier(capacity)
    if kind == "disk":
        return DiskTier(tmp / "disk", capacity)
    if kind in ("server", "server-grpc"):
        from kvtier.tiers.remote import RemoteTier
        from kvtier.tiers.remote_config import RemoteTierConfig

        server = peers["server"]
        assert isinstance(server, ServerProcess)
        return RemoteTier(
            RemoteTierConfig(
                name=kind,
                address=server.address,
                transfer_timeout_s=120,
                data_plane=kind == "server",
            )
        )
    if kind == "aerospike":
        from kvtier.tiers.aerospike import AerospikeTier
        from kvtier.tiers.aerospike_config import AerospikeTierConfig

        srv = peers["aerospike"]
        return AerospikeTier(
            AerospikeTierConfig(
                name="aerospike-test",
                hosts=[srv.address],  # type: ignore[attr-defined]
                ttl_s=3600,
                total_timeout_ms=60_000,
                socket_timeout_ms=60_000,
                write_timeout_ms=60_000,
            )
        )
    if kind == "redis":
        redis = peers["redis"]
        assert isinstance(redis, RedisProcess)
        return RedisTier(redis.port)
    raise SystemExit(
        f"unknown tier {kind!r}; this script knows: cpu, disk, server, server-grpc, redis, "
        "aerospike"
    )


def round_trips(tier: Tier) -> int | None:
    """Client round trips so far, for tiers that count them (Aerospike)."""
    stats = getattr(tier, "stats", None)
    return stats().round_trips if callable(stats) else None


def bench_tier(
    kind: str, block_bytes: int, count: int, tmp: Path, repeat: int, peers: dict[str, object]
) -> dict[str, float]:
    items = make_blocks(block_bytes, count, seed=block_bytes % 9973)
    nbytes = sum(len(b) for _, b in items)
    tier = build_tier(kind, tmp, capacity=nbytes * 4, peers=peers)
    sources = [np.frombuffer(b, dtype=np.uint8) for _, b in items]
    dst = np.empty(max(len(b) for _, b in items), dtype=np.uint8)
    # NOTE: rounds start at an offset per tier kind, so tiers that share a server
    # (server, server-grpc) never put keys the other already stored (skip_existing).
    state = {"round": zlib.crc32(kind.encode()) & 0xFFF00000}

    def put() -> None:
        # Fresh keys each round so every put really stores.
        state["round"] += 1
        r = state["round"].to_bytes(4, "little")
        # NOTE: k[:12] (the low bytes, which differ per block and per size) after the
        # round number: every block of every round gets its own key.
        tier.put([(r + k[:12], src.tobytes()) for (k, _), src in zip(items, sources, strict=True)])

    put_s = timeit(put, repeat=repeat, min_time=0.02)
    rt0 = round_trips(tier)
    tier.put(items)
    rt1 = round_trips(tier)
    keys = [k for k, _ in items]
    tier.get(keys)
    rt2 = round_trips(tier)

    def get() -> None:
        for block in tier.get(keys):
            assert block is not None
            np.copyto(dst[: len(block)], np.frombuffer(block, dtype=np.uint8))

    get_s = timeit(get, repeat=repeat, min_time=0.02)

    store = TieredStore([tier])
    trusted = tier.verifies_reads

    def load() -> None:
        for block in store.get(keys):
            assert block is not None
            payload = decode_block(block, verify=not trusted).payload
            flat = payload.reshape(-1).view(torch.uint8).numpy()
            np.copyto(dst[: flat.size], flat)

    load_s = timeit(load, repeat=repeat, min_time=0.02)
    store.close()

    def memcpy() -> None:
        # The baseline: the same blocks copied into the same destination.
        for src in sources:
            np.copyto(dst[: src.size], src)

    memcpy_s = timeit(memcpy, repeat=repeat, min_time=0.02)
    out = {
        "put": nbytes / put_s / 1e9,
        "get": nbytes / get_s / 1e9,
        "load": nbytes / load_s / 1e9,
        "memcpy": nbytes / memcpy_s / 1e9,
    }
    if rt0 is not None and rt1 is not None and rt2 is not None:
        # One batched call for all blocks: the count is per call; per block it shrinks with batch size.
        out["put_round_trips_per_block"] = (rt1 - rt0) / len(items)
        out["get_round_trips_per_block"] = (rt2 - rt1) / len(items)
        out["put_round_trips"] = rt1 - rt0
        out["get_round_trips"] = rt2 - rt1
    transport = getattr(tier, "transport", None)
    if callable(transport) and transport().fallbacks:
        # the figures are not the data plane's: say so rather than mislabel them
        print(f"warning: {kind}: {transport().fallbacks} fallbacks to gRPC", file=sys.stderr)
    tier.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats (under a minute)")
    ap.add_argument("--tiers", default="cpu,disk")
    ap.add_argument(
        "--sizes", default=None, help="comma-separated block sizes (default 256KiB..32MiB)"
    )
    ap.add_argument(
        "--server-chunk", default="1MiB", help="frame size of the benchmarked kvtier serve"
    )
    args = ap.parse_args()
    tune_allocator()
    sizes = args.sizes or ("256KiB,4MiB,32MiB" if args.quick else "256KiB,1MiB,4MiB,16MiB,32MiB")
    block_sizes = [parse_bytes(s) for s in sizes.split(",")]
    repeat = 3 if args.quick else 7
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    serving = "server" in tiers or "server-grpc" in tiers
    if serving and "redis" not in tiers:
        if RedisProcess.available():
            tiers.append("redis")
        else:
            print("note: redis-server is not on PATH; no Redis peer in this run", file=sys.stderr)

    results = []
    rows = []
    peer_memory = 2 << 30  # both peers evict (LRU) beyond this
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-"))
        peers: dict[str, object] = {}
        if serving:
            peers["server"] = stack.enter_context(
                ServerProcess(peer_memory, chunk_size=parse_bytes(args.server_chunk))
            )
        if "redis" in tiers:
            peers["redis"] = stack.enter_context(RedisProcess(peer_memory))
        if "aerospike" in tiers:
            from tests.support.aerospike_server import AerospikeTestServer

            peers["aerospike"] = stack.enter_context(AerospikeTestServer())
        for size in block_sizes:
            count = max(2, min(32, (64 << 20) // size))
            for kind in tiers:
                r = bench_tier(kind, size, count, Path(tmp) / f"{kind}-{size}", repeat, peers)
                base = r["memcpy"]
                label = "aerospike-test" if kind == "aerospike" else kind
                for op in ("put", "get", "load"):
                    ratio = r[op] / base
                    trips = r.get(f"{op}_round_trips")
                    row = {
                        "tier": label,
                        "op": op,
                        "block_bytes": size,
                        "blocks": count,
                        "gbps": round(r[op], 3),
                        "memcpy_gbps": round(base, 3),
                        "ratio_memcpy": round(ratio, 3),
                    }
                    if trips is not None:
                        row["round_trips"] = trips
                    results.append(row)
                    rt = "-" if trips is None else f"{trips:.0f} for {count}"
                    rows.append([label, op, format_bytes(size), r[op], base, ratio, rt])
    print(__doc__.split("\n")[0])
    print(table(["tier", "op", "block", "GB/s", "memcpy GB/s", "x memcpy", "round trips"], rows))
    emit({"bench": "store", "quick": args.quick, "machine": machine(), "results": results})


if __name__ == "__main__":
    main()
