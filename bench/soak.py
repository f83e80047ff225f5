"""Soak of the tiered store under injected faults, checked against a ground-truth model.

    python -m bench.soak --quick            # ~12,000 operations, under a minute
    python -m bench.soak --quick --hostile  # and a hostile tenant (bench/lib/soak_hostile.py)
    python -m bench.soak --minutes 10       # longer; --ops N stops after N operations

What runs: ``--clients`` threads issue random ``put`` / ``get`` / ``contains``
/ ``lookup`` / ``delete`` calls (1-8 keys each) on one ``TieredStore`` of

* a CPU tier, small on purpose (2 MiB): it evicts, so reads reach the lower tiers;
* a disk tier in a temporary directory, large enough that nothing is evicted;
* a remote tier: a ``kvtier serve`` cache server started in this process on
  127.0.0.1 (free ports, data plane on), itself storing on CPU + disk. It
  is closed (tokens): the honest clients are tenant ``honest``, the trusted
  writer of the shared namespace ``fleet``; with ``--hostile`` a tenant
  ``mallory`` writes the same namespace without being trusted.

Blocks are content-addressed: block ``i`` is a valid encoded block bound to
key ``i``, a function of ``i`` alone, so what a read must return is known.
A client mutates (puts, deletes) only its own keys (``i % clients``) and
reads any. The run is cut into phases; between phases the clients pause
(the *barrier*) and the model is brought up to date.

Faults (one at each barrier, in turn, and one during each phase, in turn):

* ``disk_corrupt`` / ``disk_truncate``: a byte flipped in, or the second half
  cut off, block files of acknowledged keys;
* ``disk_delete``: block files deleted behind the disk tier's back;
* ``disk_move``: one key's block file renamed onto another key's path (a
  valid block under the wrong key: the store's key binding must reject it);
* ``store_restart``: the client store closed and built again (the CPU tier
  starts empty, the disk tier re-indexes its directory);
* ``remote_errors``: for a while every remote-tier call raises a transient error;
* ``remote_stall``: for a while remote reads hang until their deadline and
  fail, and writes are slow (a stalled server; injected in a wrapper of the
  remote tier, on the client side);
* ``server_restart``: the cache server stopped with no grace (calls in
  flight are cut) and started again on the same ports, over the same
  directory, while clients run.

The keys a disk fault damaged are read back through the store at once (their
CPU-tier copies dropped first, so the read reaches the damaged file), and by
the clients later as it happens.

With ``--hostile`` a tenant with a writer token of the same namespace
(``bench/lib/soak_hostile.py``) puts wrong but otherwise valid blocks under the
keys the honest clients use — every key before they start, then random
batches all the time, some with a forged provenance trailer — and keeps
stalled Put streams, silent data-plane sockets and half-sent HTTP requests
open against the server.

Ground truth, checked by every read:

* **wrong_bytes_returned**: a read (``store.get``, or a durability check
  reading a tier directly) returned bytes for key ``i`` that are not block
  ``i``. Nothing excuses it; damaged files must be misses.
  **poisoned_blocks_served**: of those, the hostile tenant's block of ``i``.

* **puts / acknowledged**: ``puts`` counts the blocks honest clients handed
  to ``store.put``; a put is *acknowledged* when a durable tier's ``put``
  call returned success for it (the store writes the tiers below the CPU in
  the background: the call that returns there is the tier's, recorded by a
  wrapper of each durable tier, :class:`AckTier`). ``acknowledged`` counts
  the honest puts some durable tier acknowledged (per key, the most
  acknowledged by one tier: a lower bound), ``acknowledged_by_tier`` each.

* **lost_acknowledged_writes**, per durable tier T (disk, remote):

  - *acknowledged by T*: T's put call returned success for the key, it had
    started after the owner's last delete of the key ended, and no delete
    of it began since;
  - *no longer acknowledged* once the owner starts deleting it (a put after
    the delete must be acknowledged afresh); once T evicts it (the disk
    tier's eviction listener names each key; capacities are sized so that
    neither disk nor the server's disk evicts, and the server's evictions and
    writer drops are reported); or once a fault destroys it in T — the files
    a disk fault touched, listed when it strikes (T = disk only). A key
    whose file a fault damaged *in place* (corrupted, truncated, another
    key's block moved onto it) is not acknowledged by the disk again while
    that damaged file is still there: the disk tier skips a put of a key
    whose file exists, and says it holds it (dedup trusts the file until a
    read checks it); once a barrier has seen the bad file gone, a put
    acknowledged after it counts again. A deleted file excuses nothing: a
    put after it must write the block;
  - *lost*: an acknowledged key that T, read directly with no deadline, does
    not return — checked for a sample of keys at every barrier and for every
    key at the end (after restarting the server and the store), counted once
    per key and tier. Restarts and remote errors destroy nothing that is
    acknowledged: a key counts only once the server has flushed it to its
    disk, and both restarts re-index their directories. (The server's stop
    cuts the calls in flight but still closes its store: it is not a crash;
    a key still queued in a writer at a crash was never acknowledged.)

A CPU tier promises nothing (it evicts, and a restart empties it); store
reads that miss are not losses — the store is a cache — only a durable
tier's own answer is.

Reported, not judged: ``deleted_but_held`` — keys whose last mutation in a
phase was a delete that the disk tier still holds at the barrier (a read
racing with the delete promoted the block back; the bytes are right, and a
cache may hold what it was told to drop).

**read_back**: the acknowledged (tier, key) pairs the final check read back
intact. **honest_p99_ms**: the 99th percentile of the honest clients' store
calls (every get, put, contains, lookup and delete), in milliseconds.

``errors_by_kind`` adds up what the store counted (``kvtier_tier_errors_total``
by kind, corrupt blocks by tier and by reason, writer-queue drops) and any
exception that escaped a store call (``escaped``: none may). A table, then
one JSON line last; the exit status is 1 if a bar fails
(``wrong_bytes_returned == 0``, ``poisoned_blocks_served == 0``,
``lost_acknowledged_writes == 0``, ``acknowledged >= 0.9 * puts``,
``faults_injected >= 3``, ``ops >= 10000`` unless ``--ops`` asks for fewer,
no escaped exception).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.lib.common import machine, table
from kvtier.bench.lib.soak_hostile import Hostile
from kvtier.block import encode_block
from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig
from kvtier.errors import DeadlineExceededError, KvtierError, TransientError
from kvtier.metrics import StoreMetrics
from kvtier.provenance import unstamped
from kvtier.server.app import CacheServer
from kvtier.server.tenants import scope_key, untrusted_salt
from kvtier.server_config import NamespaceConfig, ServerConfig, TenantConfig
from kvtier.store import TieredStore
from kvtier.tiers.base import EvictionListener, Tier, TierUsage
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_files import block_path
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_config import RemoteTierConfig

BARRIER_FAULTS = ("disk_corrupt", "disk_truncate", "disk_delete", "disk_move", "store_restart")
PHASE_FAULTS = ("remote_errors", "remote_stall", "server_restart")
DURABLE = ("disk", "remote")
READ_DEADLINE_S = 0.5  # a request's load deadline
CPU_CAPACITY = 2 << 20
DISK_CAPACITY = 1 << 30
FILES_PER_FAULT = 4
SAMPLE_CHECK = 64  # keys per durable tier read back at each barrier
TOKENS = {"honest": "soak-honest-writer-token", "mallory": "soak-hostile-writer-token"}


# ---- blocks ---------------------------------------------------------------------


class Blocks:
    """Key ``i`` and its block, a function of ``i`` alone (1 to 64 tokens of a tiny layout)."""

    def __init__(self, n: int) -> None:
        self.keys = [hashlib.sha256(b"kvtier-soak %d" % i).digest()[:16] for i in range(n)]
        self.index = {k: i for i, k in enumerate(self.keys)}
        self._blocks: dict[int, bytes] = {}
        self._poison: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def block(self, i: int) -> bytes:
        with self._lock:
            b = self._blocks.get(i)
        if b is None:
            g = torch.Generator().manual_seed(i)
            tokens = 1 + i % 64
            kv = torch.randn(2, 2, tokens, 2, 8, generator=g).to(torch.bfloat16)
            b = encode_block(kv, key=self.keys[i])
            with self._lock:
                self._blocks[i] = b
        return b

    def poison(self, i: int) -> bytes:
        """The hostile tenant's block of key ``i``: valid, bound to the key, the wrong KV."""
        with self._lock:
            b = self._poison.get(i)
        if b is None:
            g = torch.Generator().manual_seed(1_000_000 + i)
            kv = torch.randn(2, 2, 1 + i % 64, 2, 8, generator=g).to(torch.bfloat16)
            b = encode_block(kv, key=self.keys[i])
            with self._lock:
                self._poison[i] = b
        return b


# ---- a remote tier that can be made to fail or stall ------------------------------


class FaultyTier(Tier):
    """Passes every call to ``inner`` unless a fault window is open (see the module docstring)."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self.name = inner.name
        self.verifies_reads = inner.verifies_reads
        self.mode: str | None = None
        self.until = 0.0

    def _fault(self) -> str | None:
        mode = self.mode
        if mode is not None and time.monotonic() >= self.until:
            self.mode = mode = None
        return mode

    def _read_fault(self, deadline: float | None) -> None:
        mode = self._fault()
        if mode == "remote_errors":
            raise TransientError("injected: remote tier unavailable")
        if mode == "remote_stall":
            wait = 0.2 if deadline is None else max(0.0, deadline - time.monotonic())
            time.sleep(min(wait, 1.0))
            raise DeadlineExceededError("injected: remote tier stalled past the deadline")

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        self._read_fault(deadline)
        return self.inner.contains(keys, deadline=deadline)

    def get(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bytes | None]:
        self._read_fault(deadline)
        return self.inner.get(keys, deadline=deadline)

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        mode = self._fault()
        if mode == "remote_errors":
            raise TransientError("injected: remote tier unavailable")
        if mode == "remote_stall":
            time.sleep(0.05)
        return self.inner.put(items)

    def delete(self, keys: Sequence[bytes]) -> int:
        if self._fault() == "remote_errors":
            raise TransientError("injected: remote tier unavailable")
        return self.inner.delete(keys)

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        self.inner.set_eviction_listener(listener)

    def close(self) -> None:
        self.inner.close()


class AckTier(FaultyTier):
    """A durable tier whose put calls report what they acknowledged to the ledger.

    (A :class:`FaultyTier` whose fault window never opens, when ``faulty`` is ``None``.)
    """

    def __init__(self, inner: Tier, label: str, ledger: Ledger) -> None:
        super().__init__(inner)
        self.label = label
        self.ledger = ledger

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        start = time.monotonic()
        stored = super().put(items)  # raises: nothing acknowledged
        self.ledger.acknowledge(
            self.label, start, [k for (k, _), ok in zip(items, stored, strict=True) if ok]
        )
        return stored


# ---- the system under test ----------------------------------------------------------


class Rig:
    """The store, its tiers and the cache server, with restarts."""

    def __init__(self, root: Path, metrics: StoreMetrics, ledger: Ledger, hostile: bool) -> None:
        self.root = root
        self.metrics = metrics
        self.ledger = ledger
        self.hostile = hostile
        self.evicted: dict[str, set[bytes]] = {"disk": set(), "remote": set()}
        probe = CacheServer(self._server_config(0, 0), self._server_store_config())
        probe.start()
        self.port, self.data_port = probe.port, probe.data_port or 0
        self.http_port = probe.http_port or 0
        self.server = probe
        self.server_restarts = 0
        self.server_counts: Counter[str] = Counter()  # of every server so far
        self.store = self._build_store()

    def _server_config(self, port: int, data_port: int, http_port: int = 0) -> ServerConfig:
        def tenant(name: str, **kw: Any) -> TenantConfig:
            digest = hashlib.sha256(TOKENS[name].encode()).hexdigest()
            return TenantConfig(name=name, token_sha256=digest, namespace="fleet", **kw)

        return ServerConfig(
            host="127.0.0.1",
            port=port,
            data_port=data_port,
            http_port=http_port if self.hostile else None,
            threads=16,  # a tenant may hold 8
            open=False,
            namespaces=[NamespaceConfig(name="fleet", trusted_writers=["honest"])],
            tenants=[tenant("honest"), tenant("mallory", reads="any")],
            stream_idle_timeout_s=2.0,
            data_handshake_timeout_s=2.0,
            http_timeout_s=2.0,
        )

    def _server_store_config(self) -> KvtierConfig:
        return KvtierConfig(
            tiers=[
                CpuTierConfig(capacity=8 << 20),
                DiskTierConfig(path=self.root / "server", capacity=DISK_CAPACITY),
            ]
        )

    def _build_store(self) -> TieredStore:
        self.disk = DiskTier(self.root / "disk", DISK_CAPACITY, metrics=self.metrics)
        self.remote_inner = RemoteTier(
            RemoteTierConfig(
                address=f"127.0.0.1:{self.port}",
                token=TOKENS["honest"],
                timeout_s=2.0,
                breaker_reset_s=0.5,  # back soon after a fault window: the remote is exercised
            ),
            metrics=self.metrics,
        )
        self.remote = AckTier(self.remote_inner, "remote", self.ledger)
        store = TieredStore(
            [
                CpuTier(CPU_CAPACITY, metrics=self.metrics),
                AckTier(self.disk, "disk", self.ledger),
                self.remote,
            ],
            metrics=self.metrics,
        )
        self.disk.set_eviction_listener(lambda k, _b: self.evicted["disk"].add(k))
        return store

    def restart_store(self) -> None:
        self.store.close()
        self.store = self._build_store()

    def restart_server(self, pause_s: float) -> None:
        self._count_server()
        self.server.stop(grace=0)
        time.sleep(pause_s)
        last: Exception | None = None
        for _ in range(50):  # the ports may take a moment to be free again
            try:
                self.server = CacheServer(
                    self._server_config(self.port, self.data_port, self.http_port),
                    self._server_store_config(),
                ).start()
                self.server_restarts += 1
                return
            except KvtierError as e:
                last = e
                time.sleep(0.1)
        raise RuntimeError(f"cache server did not restart: {last}")

    def flush(self) -> None:
        self.store.flush(60.0)
        self.server.store.flush(60.0)

    def _count_server(self) -> None:
        m = self.server.store_metrics
        self.server_counts["disk_evictions"] += int(
            m.value("kvtier_evictions_total", {"tier": "disk"})
        )
        for t in ("cpu", "disk"):
            self.server_counts[f"{t}_writer_dropped"] += int(
                m.value("kvtier_writer_dropped_total", {"tier": t})
            )
        for family in self.server.registry.collect():  # what the server refused or cut
            for sample in family.samples:
                if sample.name == "kvtier_server_rejected_total":
                    self.server_counts[f"rejected:{sample.labels['reason']}"] += int(sample.value)
                elif sample.name == "kvtier_server_cancelled_calls_total":
                    self.server_counts[f"cancelled:{sample.labels['reason']}"] += int(sample.value)
                elif sample.name == "kvtier_server_withheld_blocks_total":
                    self.server_counts[f"withheld:{sample.labels['reason']}"] += int(sample.value)

    def close(self) -> None:
        self.store.close()
        self.server.stop(grace=0)


# ---- the model ----------------------------------------------------------------------


@dataclass
class Ledger:
    """What the clients did and what the durable tiers acknowledged (module docstring)."""

    blocks: Blocks
    acked: dict[str, set[int]] = field(default_factory=lambda: {t: set() for t in DURABLE})
    lost: dict[str, set[int]] = field(default_factory=lambda: {t: set() for t in DURABLE})
    wrong: list[str] = field(default_factory=list)
    last_mutation: dict[int, str] = field(default_factory=dict)  # this phase
    deleted: set[int] = field(default_factory=set)  # deleted at least once this phase
    ops: Counter[str] = field(default_factory=Counter)
    keys_touched: int = 0
    escaped: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    deleted_but_held: int = 0
    checks: int = 0
    damaged: dict[int, str] = field(default_factory=dict)  # key -> the last disk fault on it
    tainted: set[int] = field(default_factory=set)  # damaged disk files still in place
    poisoned: int = 0  # reads that returned the hostile tenant's block
    put_count: Counter[int] = field(default_factory=Counter)  # honest puts per key
    ack_count: dict[str, Counter[int]] = field(
        default_factory=lambda: {t: Counter[int]() for t in DURABLE}
    )
    deleting: Counter[int] = field(default_factory=Counter)  # deletes in flight per key
    delete_done: dict[int, float] = field(default_factory=dict)  # when the last one ended
    read_back: int = 0  # acknowledged (tier, key) read back intact by the final check
    unreadable: int = 0  # acknowledged (tier, key) the final check could not read (tier error)
    final_acked: int = 0  # acknowledged (tier, key) pairs the final check read
    latencies: list[float] = field(default_factory=list)  # honest store calls, seconds
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, source: str, ids: Sequence[int], got: Sequence[bytes | None]) -> int:
        """Check what a read returned; how many blocks were intact."""
        intact = 0
        for i, b in zip(ids, got, strict=True):
            if b is None:
                continue
            if b == self.blocks.block(i):
                intact += 1
                continue
            with self.lock:
                self.wrong.append(f"{source}: key {i} ({len(b)} bytes)")
                if b == self.blocks.poison(i):
                    self.poisoned += 1
        return intact

    def forget(self, tier: str, ids: set[int]) -> None:
        """A fault destroyed these keys in ``tier``: they are not acknowledged there any more."""
        self.acked[tier] -= ids

    def acknowledge(self, tier: str, start: float, keys: Sequence[bytes]) -> None:
        """``tier``'s put call, started at ``start``, returned success for ``keys``."""
        with self.lock:
            for k in keys:
                i = self.blocks.index[k]
                self.ack_count[tier][i] += 1
                if self.deleting[i] or start <= self.delete_done.get(i, -1.0):
                    continue  # a delete ran beside it: which came last is unknown
                if tier == "disk" and i in self.tainted:
                    continue  # the damaged file may be what the dedup kept
                self.acked[tier].add(i)

    def begin_delete(self, ids: Sequence[int]) -> None:
        with self.lock:
            for i in ids:
                self.deleting[i] += 1
                for t in DURABLE:
                    self.acked[t].discard(i)

    def end_delete(self, ids: Sequence[int]) -> None:
        with self.lock:
            now = time.monotonic()
            for i in ids:
                self.deleting[i] -= 1
                self.delete_done[i] = now

    def acknowledged(self) -> int:
        """Honest puts some durable tier acknowledged (per key, the most of one tier)."""
        return sum(
            min(n, max(self.ack_count[t][i] for t in DURABLE)) for i, n in self.put_count.items()
        )


def client(
    c: int, rig: Rig, ledger: Ledger, n_ops: int, clients: int, seed: int, stop: threading.Event
) -> None:
    rng = random.Random(seed)
    n = len(ledger.blocks.keys)
    mine = list(range(c, n, clients))
    ops = Counter[str]()
    touched = 0
    latencies: list[float] = []
    for _ in range(n_ops):
        if stop.is_set():
            break
        op = rng.choices(("get", "put", "contains", "lookup", "delete"), (45, 30, 12, 8, 5))[0]
        k = rng.randint(1, 8)
        ids = rng.sample(mine, k) if op in ("put", "delete") else rng.sample(range(n), k)
        keys = [ledger.blocks.keys[i] for i in ids]
        store = rig.store  # a store restart happens only at a barrier
        if op == "put":
            with ledger.lock:
                ledger.put_count.update(ids)
        elif op == "delete":
            ledger.begin_delete(ids)
        t0 = time.perf_counter()
        try:
            if op == "get":
                got = store.get(keys, deadline=time.monotonic() + READ_DEADLINE_S)
                latencies.append(time.perf_counter() - t0)
                ledger.read("store.get", ids, got)
            elif op == "put":
                store.put([(key, ledger.blocks.block(i)) for key, i in zip(keys, ids, strict=True)])
            elif op == "contains":
                store.contains(keys, deadline=time.monotonic() + READ_DEADLINE_S)
            elif op == "lookup":
                store.lookup(keys, deadline=time.monotonic() + READ_DEADLINE_S)
            else:
                store.delete(keys)
        except Exception as e:  # a cache failure must never reach its caller: count it
            with ledger.lock:
                ledger.escaped[f"{op}: {type(e).__name__}"] += 1
        finally:
            if op == "delete":
                ledger.end_delete(ids)
        if op != "get":
            latencies.append(time.perf_counter() - t0)
        if op in ("put", "delete"):
            with ledger.lock:
                for i in ids:
                    ledger.last_mutation[i] = op
                if op == "delete":
                    ledger.deleted.update(ids)
        ops[op] += 1
        touched += k
    with ledger.lock:
        ledger.ops.update(ops)
        ledger.keys_touched += touched
        ledger.latencies.extend(latencies)


# ---- faults -------------------------------------------------------------------------


def disk_fault(kind: str, rig: Rig, ledger: Ledger, rng: random.Random) -> int:
    """Damages block files of acknowledged keys; returns how many files it touched."""
    held = sorted(ledger.acked["disk"])
    victims = rng.sample(held, min(len(held), 2 if kind == "disk_move" else FILES_PER_FAULT))
    blocks_dir = rig.root / "disk" / "blocks"
    paths = [block_path(blocks_dir, ledger.blocks.keys[i]) for i in victims]
    touched: set[int] = set()
    if kind == "disk_move":
        if len(paths) == 2 and paths[0].exists():
            os.replace(paths[0], paths[1])  # key 1's path now holds key 0's (valid) block
            touched = set(victims)
            ledger.tainted.add(victims[1])
    else:
        for i, p in zip(victims, paths, strict=True):
            try:
                data = p.read_bytes()
            except FileNotFoundError:
                continue
            if kind == "disk_corrupt":
                flipped = bytearray(data)
                flipped[rng.randrange(len(flipped))] ^= 0x20
                p.write_bytes(bytes(flipped))
            elif kind == "disk_truncate":
                p.write_bytes(data[: len(data) // 2])
            else:
                p.unlink()
            touched.add(i)
            if kind != "disk_delete":
                ledger.tainted.add(i)
    ledger.forget("disk", touched)
    for i in touched:
        ledger.damaged[i] = kind
    # Every damaged key is read through the store at once (and by the clients later), with
    # the CPU tier's copy dropped first so that the read reaches the damaged file.
    keys = [ledger.blocks.keys[i] for i in sorted(touched)]
    rig.store.tiers[0].delete(keys)
    ledger.read("store.get after a fault", sorted(touched), rig.store.get(keys))
    return len(touched)


def phase_fault(kind: str, rig: Rig, rng: random.Random, phase_s: float) -> None:
    """Runs during a phase: opens a fault window on the remote tier, or restarts the server."""
    time.sleep(rng.uniform(0.1, 0.4) * phase_s)
    if kind == "server_restart":
        rig.restart_server(pause_s=rng.uniform(0.1, 0.3))
    else:
        rig.remote.until = time.monotonic() + rng.uniform(0.2, 0.5) * phase_s
        rig.remote.mode = kind


# ---- barriers -----------------------------------------------------------------------


def barrier(rig: Rig, ledger: Ledger) -> None:
    """Flush everything (every put call returns), then account for evictions and damage."""
    rig.flush()
    mutated = ledger.last_mutation
    ledger.last_mutation, ledger.deleted = {}, set()
    gone = sorted(i for i, op in mutated.items() if op == "delete")
    if gone:
        ledger.deleted_but_held += sum(rig.disk.contains([ledger.blocks.keys[i] for i in gone]))
    evicted = {ledger.blocks.index[k] for t in DURABLE for k in rig.evicted[t]}
    blocks_dir = rig.root / "disk" / "blocks"
    for i in sorted(ledger.tainted):  # is the damaged file still there?
        try:
            ok = block_path(blocks_dir, ledger.blocks.keys[i]).read_bytes() == ledger.blocks.block(
                i
            )
        except FileNotFoundError:
            ok = True
        if ok:
            ledger.tainted.discard(i)
    for t in DURABLE:  # acknowledgements came from the put calls (AckTier)
        ledger.acked[t] -= evicted


def check_durable(rig: Rig, ledger: Ledger, sample: int | None, rng: random.Random) -> None:
    """Reads acknowledged keys from each durable tier directly (a sample, or all: the final
    check, which also counts what it read back)."""
    for t, tier in (("disk", rig.disk), ("remote", rig.remote_inner)):
        ids = sorted(ledger.acked[t] - ledger.lost[t])
        if sample is not None:
            ids = rng.sample(ids, min(sample, len(ids)))
        else:
            ledger.final_acked += len(ids)
        for start in range(0, len(ids), 256):
            part = ids[start : start + 256]
            got = _read_durable(tier, [ledger.blocks.keys[i] for i in part], final=sample is None)
            if got is None:  # a transient failure is not a loss; the final check reads again
                if sample is None:
                    ledger.unreadable += len(part)
                continue
            ledger.checks += len(part)
            intact = ledger.read(f"{t}.get", part, got)
            if sample is None:
                ledger.read_back += intact
            ledger.lost[t] |= {i for i, b in zip(part, got, strict=True) if b is None}


def _read_durable(tier: Tier, keys: list[bytes], *, final: bool) -> list[bytes | None] | None:
    """``tier.get(keys)``; ``None`` if it failed (the final check tries three times)."""
    for attempt in range(3 if final else 1):
        try:
            return tier.get(keys)
        except KvtierError:
            time.sleep(0.5 * attempt)
    return None


# ---- the run ------------------------------------------------------------------------


def errors_by_kind(metrics: StoreMetrics, ledger: Ledger) -> dict[str, int]:
    out: Counter[str] = Counter()
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "kvtier_tier_errors_total":
                out[s.labels["kind"]] += int(s.value)
            elif s.name == "kvtier_corrupt_blocks_total":
                out[f"corrupt_blocks:{s.labels['tier']}"] += int(s.value)
            elif s.name == "kvtier_corrupt_block_reasons_total":
                out[f"corrupt_reason:{s.labels['reason']}"] += int(s.value)
            elif s.name == "kvtier_writer_dropped_total":
                out["writer_dropped"] += int(s.value)
    out["escaped"] = sum(ledger.escaped.values())
    return {k: v for k, v in sorted(out.items()) if v or k == "escaped"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    metrics = StoreMetrics()
    blocks = Blocks(args.keys)
    ledger = Ledger(blocks)
    rig = Rig(root, metrics, ledger, args.hostile)
    rss_start = _rss_mb()
    started = time.monotonic()
    budget_s = args.minutes * 60.0
    phases = 0
    phase_s = 1.0  # measured: the last phase's duration, for timing the in-phase faults
    hostile: Hostile | None = None
    poison_visible = 0
    if args.hostile:
        hostile = Hostile(
            rig.server.address,
            rig.data_port,
            rig.http_port,
            TOKENS["mallory"],
            blocks.keys,
            blocks.poison,
            "honest",
            rng.getrandbits(32),
        )
        hostile.pre_poison()  # every key holds a poisoned block before the first honest put
        hostile.start()
    try:
        while sum(ledger.ops.values()) < args.ops and time.monotonic() - started < budget_s:
            left = args.ops - sum(ledger.ops.values())
            per_client = max(1, min(args.phase_ops, left) // args.clients)
            stop = threading.Event()
            threads = [
                threading.Thread(
                    target=client,
                    args=(c, rig, ledger, per_client, args.clients, rng.getrandbits(32), stop),
                )
                for c in range(args.clients)
            ]
            kind = PHASE_FAULTS[phases % len(PHASE_FAULTS)]
            faulter = threading.Thread(target=phase_fault, args=(kind, rig, rng, phase_s))
            t0 = time.monotonic()
            for t in [*threads, faulter]:
                t.start()
            faulter.join()
            ledger.faults[kind] += 1
            for t in threads:
                t.join()
            phase_s = time.monotonic() - t0
            rig.remote.mode = None
            barrier(rig, ledger)
            check_durable(rig, ledger, SAMPLE_CHECK, rng)
            kind = BARRIER_FAULTS[phases % len(BARRIER_FAULTS)]
            if kind == "store_restart":
                rig.restart_store()
                ledger.faults[kind] += 1
            elif disk_fault(kind, rig, ledger, rng):
                ledger.faults[kind] += 1
            phases += 1
        elapsed = time.monotonic() - started
        if hostile is not None:
            poison_visible = _poison_stored(rig, blocks, rng)
            hostile.close()
            ledger.faults.update(hostile.faults())
        # The end: both restarted, then every acknowledged key read back from each durable tier.
        rig.restart_server(pause_s=0.1)
        rig.restart_store()
        check_durable(rig, ledger, None, rng)
        rig._count_server()
    finally:
        if hostile is not None:
            hostile.close()
        rig.close()
        shutil.rmtree(root, ignore_errors=True)
    ops = sum(ledger.ops.values())
    lost = sum(len(v) for v in ledger.lost.values())
    faults = sum(ledger.faults.values())
    puts = sum(ledger.put_count.values())
    acknowledged = ledger.acknowledged()
    result: dict[str, Any] = {
        "ops": ops,
        "puts": puts,
        "acknowledged": acknowledged,
        "read_back": ledger.read_back,
        "lost_acknowledged_writes": lost,
        "wrong_bytes_returned": len(ledger.wrong),
        "poisoned_blocks_served": ledger.poisoned,
        "faults_injected": faults,
        "honest_p99_ms": _p99_ms(ledger.latencies),
        "errors_by_kind": errors_by_kind(metrics, ledger),
        "hostile": args.hostile,
        "acknowledged_by_tier": {t: sum(c.values()) for t, c in ledger.ack_count.items()},
        "final_check": {
            "acknowledged_pairs": ledger.final_acked,
            "read_back": ledger.read_back,
            "lost": lost,
            "unreadable": ledger.unreadable,
        },
        "poison_stored_of_256_keys": poison_visible,
        "hostile_counts": dict(sorted(hostile.counts.items())) if hostile is not None else {},
        "faults_by_kind": dict(sorted(ledger.faults.items())),
        "ops_by_kind": dict(sorted(ledger.ops.items())),
        "keys_touched": ledger.keys_touched,
        "seconds": round(elapsed, 1),
        "ops_per_s": round(ops / elapsed, 1),
        "phases": phases,
        "clients": args.clients,
        "keys": args.keys,
        "acknowledged_at_end": {t: len(v) for t, v in ledger.acked.items()},
        "lost_by_tier": {t: len(v) for t, v in ledger.lost.items()},
        "durability_reads": ledger.checks,
        "evictions": {"disk": len(rig.evicted["disk"])},
        "server": dict(rig.server_counts),
        "deleted_but_held": ledger.deleted_but_held,
        "escaped": dict(ledger.escaped),
        "wrong_examples": ledger.wrong[:5],
        "lost_examples": [
            f"{t}: key {i}" + (f" (earlier {ledger.damaged[i]})" if i in ledger.damaged else "")
            for t in DURABLE
            for i in sorted(ledger.lost[t])[:5]
        ],
        "rss_mb": {"start": rss_start, "end": _rss_mb()},
        "seed": args.seed,
        "machine": machine(),
    }
    result["bars"] = {
        "wrong_bytes_returned == 0": result["wrong_bytes_returned"] == 0,
        "poisoned_blocks_served == 0": ledger.poisoned == 0,
        "lost_acknowledged_writes == 0": lost == 0,
        "acknowledged >= 0.9 * puts": acknowledged >= 0.9 * puts,
        "faults_injected >= 3": faults >= 3,
        f"ops >= {min(10000, args.ops)}": ops >= min(10000, args.ops),
        "no escaped exception": not ledger.escaped,
    }
    return result


def _poison_stored(rig: Rig, blocks: Blocks, rng: random.Random, sample: int = 256) -> int:
    """Of ``sample`` keys, how many poisoned blocks the server holds (in the untrusted slot)."""
    ids = rng.sample(range(len(blocks.keys)), min(sample, len(blocks.keys)))
    slot = untrusted_salt("fleet")
    keys = [blocks.keys[i] for i in ids]
    got = rig.server.store.get([scope_key(slot, k) for k in keys], bound_to=keys)
    return sum(
        b is not None and bytes(unstamped(b)) == blocks.poison(i)
        for i, b in zip(ids, got, strict=True)
    )


def _p99_ms(seconds: list[float]) -> float:
    if not seconds:
        return float("nan")
    ordered = sorted(seconds)
    return round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 2)


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="12,000 operations (under a minute)")
    ap.add_argument("--minutes", type=float, default=None, help="time bound (default 10; quick 1)")
    ap.add_argument("--ops", type=int, default=None, help="stop after this many operations")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--keys", type=int, default=2000, help="size of the key space")
    ap.add_argument("--phase-ops", type=int, default=None, help="operations between barriers")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--hostile",
        action="store_true",
        help="a hostile tenant poisons keys and stalls streams (bench/lib/soak_hostile.py)",
    )
    args = ap.parse_args(argv)
    if args.ops is None:
        args.ops = 12_000 if args.quick else 10**9
    if args.minutes is None:
        args.minutes = 1.0 if args.quick else 10.0
    if args.phase_ops is None:
        args.phase_ops = max(40, min(600, args.ops // 16))
    if args.ops < 1 or args.clients < 1 or args.keys < 2 * args.clients * 8 or args.minutes <= 0:
        ap.error("need --ops >= 1, --clients >= 1, --minutes > 0 and --keys >= 16 * clients")
    r = run(args)
    print(
        table(
            ["figure", "value"],
            [
                ["operations", r["ops"]],
                ["keys touched", r["keys_touched"]],
                ["seconds", r["seconds"]],
                ["operations / s", r["ops_per_s"]],
                ["phases", r["phases"]],
                ["faults injected", r["faults_injected"]],
                *[[f"  {k}", v] for k, v in r["faults_by_kind"].items()],
                ["puts (honest)", r["puts"]],
                ["acknowledged", r["acknowledged"]],
                *[[f"  acknowledged by {t}", v] for t, v in r["acknowledged_by_tier"].items()],
                ["read back (final check)", r["read_back"]],
                ["wrong bytes returned", r["wrong_bytes_returned"]],
                ["poisoned blocks served", r["poisoned_blocks_served"]],
                ["lost acknowledged writes", r["lost_acknowledged_writes"]],
                ["honest p99 (ms)", r["honest_p99_ms"]],
                ["durability reads", r["durability_reads"]],
                *[[f"error {k}", v] for k, v in r["errors_by_kind"].items()],
                ["RSS MB start / end", f"{r['rss_mb']['start']} / {r['rss_mb']['end']}"],
            ],
        )
    )
    for bar, ok in r["bars"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {bar}")
    print(json.dumps(r))
    return 0 if all(r["bars"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
