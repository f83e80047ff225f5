"""What provenance stamps cost the cache server: stamping on put, checking on reads from shared storage.

    python -m bench.provenance --quick     # 4 MiB blocks only (seconds)
    python -m bench.provenance             # 256 KiB, 4 MiB (about a SmolLM2 chunk) and 32 MiB

For each block size: the time of :func:`kvtier.provenance.stamp` (a SHA-256
pass over the block, an HMAC, and one copy of the block with its trailer:
what the server adds to every put) and of :func:`kvtier.provenance.check`
(a SHA-256 pass: what it adds to every block read back from a tier that does
not verify its reads, e.g. Aerospike), median of ``--repeat`` calls. Then,
through a live ``kvtier serve`` on loopback (data plane, CPU store), the
put and get throughput of 64 MiB of such blocks, to set the stamp's cost
against the whole put path it is part of. Last, the per-call bookkeeping
of the per-tenant limits (admit and release a call in the gate, watch and
forget a stream in the reaper), which every call pays. A table, then one
JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from kvtier.bench.lib.common import machine, table
from kvtier.block import encode_block
from kvtier.config import CpuTierConfig, KvtierConfig
from kvtier.keys import KEY_BYTES
from kvtier.provenance import check, stamp
from kvtier.server.app import CacheServer
from kvtier.server_config import ServerConfig
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_config import RemoteTierConfig

SIZES = {"256KiB": 256 << 10, "4MiB": 4 << 20, "32MiB": 32 << 20}
TOTAL = 64 << 20


def _block(i: int, nbytes: int) -> tuple[bytes, bytes]:
    key = i.to_bytes(KEY_BYTES, "little")
    tokens = max(1, nbytes // (2 * 2 * 8 * 128 * 2))  # [2 layers, K/V, tokens, 8 heads, 128] bf16
    kv = torch.randn(2, 2, tokens, 8, 128, generator=torch.Generator().manual_seed(i))
    return key, encode_block(kv.to(torch.bfloat16), key=key)


def _median(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(label: str, nbytes: int, repeat: int) -> dict[str, Any]:
    secret, scope = b"s" * 32, b"x" * KEY_BYTES
    _, block = _block(1, nbytes)
    stamped = stamp(block, writer="engine-1", secret=secret, scope=scope)
    t_stamp = _median(lambda: stamp(block, writer="engine-1", secret=secret, scope=scope), repeat)
    t_check = _median(lambda: check(stamped, secret=secret, scope=scope), repeat)
    n = max(1, TOTAL // len(block))
    items = [_block(i, nbytes) for i in range(2, 2 + n)]
    server = CacheServer(
        ServerConfig(host="127.0.0.1", port=0, http_port=None),
        KvtierConfig(tiers=[CpuTierConfig(capacity=4 * TOTAL)]),
    ).start()
    tier = RemoteTier(RemoteTierConfig(address=server.address, skip_existing=False))
    try:
        tier.put(items[:1])  # connect, learn the limits
        t0 = time.perf_counter()
        assert tier.put(items) == [True] * len(items)
        t_put = time.perf_counter() - t0
        keys = [k for k, _ in items]
        t_get = _median(lambda: tier.get(keys), 3)
    finally:
        tier.close()
        server.stop(grace=1)
    nbytes_total = sum(len(b) for _, b in items)
    return {
        "block": label,
        "block_bytes": len(block),
        "stamp_ms": t_stamp * 1000,
        "check_ms": t_check * 1000,
        "stamp_gb_s": len(block) / t_stamp / 1e9,
        "check_gb_s": len(block) / t_check / 1e9,
        "server_put_gb_s": nbytes_total / t_put / 1e9,
        "server_get_gb_s": nbytes_total / t_get / 1e9,
        "stamp_share_of_put": (t_stamp * len(items)) / t_put,
    }


def measure_limits(calls: int = 20000) -> dict[str, float]:
    """Microseconds of the per-call bookkeeping of the per-tenant limits."""
    from prometheus_client import CollectorRegistry

    from kvtier.server.deadlines import Reaper
    from kvtier.server.gate import Gate
    from kvtier.server.metrics import ServerMetrics
    from kvtier.server.tenants import TenantDirectory

    config = ServerConfig(host="127.0.0.1")
    directory = TenantDirectory(config)
    gate = Gate(directory, config, ServerMetrics(CollectorRegistry()))
    tenant = directory.anonymous
    t0 = time.perf_counter()
    for _ in range(calls):
        gate.admit(tenant)
        gate.release(tenant)
    admit = (time.perf_counter() - t0) / calls
    reaper = Reaper()
    t0 = time.perf_counter()
    for _ in range(calls):
        w = reaper.watch(lambda: None, idle_s=60, total_s=60)
        w.touch()
        w.close()
    watch = (time.perf_counter() - t0) / calls
    reaper.close()
    return {"admit_release_us": admit * 1e6, "watch_touch_close_us": watch * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 MiB blocks only")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    sizes = {"4MiB": SIZES["4MiB"]} if args.quick else SIZES
    rows = [measure(label, n, args.repeat) for label, n in sizes.items()]
    print(
        table(
            ["block", "stamp ms", "stamp GB/s", "check ms", "put GB/s (server)", "stamp / put"],
            [
                [
                    r["block"],
                    r["stamp_ms"],
                    r["stamp_gb_s"],
                    r["check_ms"],
                    r["server_put_gb_s"],
                    r["stamp_share_of_put"],
                ]
                for r in rows
            ],
        )
    )
    limits = measure_limits()
    print(
        f"per-tenant limits: admit + release {limits['admit_release_us']:.2f} us per call, "
        f"watch + touch + close {limits['watch_touch_close_us']:.2f} us per stream"
    )
    print(json.dumps({"rows": rows, "limits": limits, "machine": machine()}))


if __name__ == "__main__":
    main()
