"""Clients for ``bench/tier_load.py``: each one a process of its own, as engines are.

One Python process per client, each with its own store clients (connections,
thread pools): N clients are N processes, like N engine processes of a fleet.
(Threads of one process share its GIL: each round trip's return then waits
behind other threads' copies of multi-megabyte objects, which measures the
interpreter more than the store; :class:`ThreadDriver` keeps that mode.)

A phase runs a *group* of stores that share one server (the raw client and
the tier): every client alternates between them call by call, so both see
the same load and the same moments of a host that other work keeps busy.

:class:`WorkerPool` forks the processes once, with the objects already in
memory and before the parent makes any store client, and drives them over
pipes: every active worker gets the same start time, runs its timed calls
and answers with its latencies, per store.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import Any

from kvtier.bench.tier_load_clients import (
    LoadClient,
    PerThread,
    RawAerospike,
    TierClient,
    bound_to,
    same_object,
)

Store = tuple[str, dict[str, Any], list[bytes]]
"""(label, description for :func:`make_client`, keys of the stored objects a get reads)."""


@dataclass
class PhaseResult:
    """What one client measured of one store in one phase."""

    latencies: list[float] = field(default_factory=list)
    own_s: list[float] = field(default_factory=list)  # per call: time outside round trips
    round_trips: int = 0
    busy_s: float = 0.0
    moved: int = 0
    errors: int = 0
    wrong: int = 0


def make_client(spec: dict[str, Any]) -> LoadClient:
    """A store client from a picklable description (made in the client process)."""
    kind = spec["kind"]
    if kind in ("aerospike", "aerospike-raw"):
        from kvtier.tiers.aerospike_config import AerospikeTierConfig

        config = AerospikeTierConfig.model_validate(spec["config"])
        if kind == "aerospike-raw":
            return RawAerospike(config, spec["segment_size"], spec["object_bytes"])
        from kvtier.tiers.aerospike import AerospikeTier

        return TierClient(AerospikeTier(config))
    if kind == "server":
        from kvtier.tiers.remote import RemoteTier
        from kvtier.tiers.remote_config import RemoteTierConfig

        return TierClient(
            RemoteTier(
                RemoteTierConfig(name="server", address=spec["address"], transfer_timeout_s=120)
            )
        )
    if kind == "redis":
        from kvtier.bench.lib.peers import RedisTier

        return PerThread(lambda: TierClient(RedisTier(spec["port"])))
    raise ValueError(f"unknown store {kind!r}")


def run_client(
    clients: dict[str, LoadClient],
    group: list[Store],
    op: str,
    ops: int,
    block: bytes,
    start_at: float,
    ci: int,
    warmed: set[str],
) -> dict[str, PhaseResult]:
    """One client's phase: ``ops`` timed calls per store, alternating between the stores.

    A store this client has not used yet gets one untimed get first (connections, the
    pool), recorded in ``warmed``: once per client and store, not once per phase.

    A put stores a fresh key (the object encoded for it before the timer starts),
    deleted right after the timed call (memory stays bounded); a get reads a
    stored object and compares it byte for byte.
    """
    out = {label: PhaseResult() for label, _, _ in group}
    for label, _, pool in group:  # warm: connections, the pool
        if label in warmed:
            continue
        warmed.add(label)
        with contextlib.suppress(Exception):
            clients[label].get(pool[ci % len(pool)])
    time.sleep(max(0.0, start_at - time.time()))
    for j in range(ops * len(group)):
        label, _, pool = group[(ci + j) % len(group)]
        client, res = clients[label], out[label]
        if op == "put":
            key = os.urandom(16)
            obj = bound_to(block, key)  # untimed: what the writer encoded
        else:
            key = pool[(ci + j // len(group)) % len(pool)]
        timed = client if isinstance(client, TierClient) else None
        in_rt, n_rt = (timed.client_s, timed.round_trips) if timed else (0.0, 0)
        t0 = time.perf_counter()
        try:
            got = client.put(key, obj) if op == "put" else client.get(key)
        except Exception:  # a kvtier error, or the raw client's: counted, not timed
            res.errors += 1
            continue
        took = time.perf_counter() - t0
        res.busy_s += took
        res.latencies.append(took)
        if timed is not None and timed.round_trips > n_rt:
            res.own_s.append(took - (timed.client_s - in_rt))
            res.round_trips += timed.round_trips - n_rt
        res.moved += len(block)
        if op == "put":
            if got is not True:
                res.errors += 1
            with contextlib.suppress(Exception):
                client.delete(key)
        elif not same_object(got, block, key):
            res.wrong += 1
        del got
    return out


@dataclass
class KillLoad:
    """What one client did while a node was killed (see ``node_kill`` in bench/tier_load.py)."""

    counts: dict[str, int] = field(default_factory=dict)
    calls: list[tuple[float, float, str]] = field(default_factory=list)  # (since t0, s, op)
    live: dict[bytes, int] = field(default_factory=dict)  # acknowledged key -> xxh3_128


def kill_load(config: dict[str, Any], block: bytes, ci: int, t0: float, stop: str) -> KillLoad:
    """Put and get through one tier until the file ``stop`` exists.

    Each put stores a fresh key with bytes of this client's own (the block's tail
    changed), in a ring of 3: the oldest acknowledged key is deleted first. Each
    get reads one of this client's acknowledged keys and checks its bytes. A
    kvtier error is what the store turns into a recompute or a dropped save;
    any other exception would reach an engine (``failed``).
    """
    import xxhash

    from kvtier.errors import KvtierError
    from kvtier.tiers.aerospike import AerospikeTier
    from kvtier.tiers.aerospike_config import AerospikeTierConfig

    tier = AerospikeTier(AerospikeTierConfig.model_validate(config))
    with contextlib.suppress(KvtierError):  # warm: connections, as an engine has them
        tier.get([os.urandom(16)])
    ring = 3
    variants = [block[:-16] + (ci * ring + s).to_bytes(16, "little") for s in range(ring)]
    digests = [xxhash.xxh3_128_intdigest(v) for v in variants]
    out = KillLoad(counts=dict.fromkeys(
        ("puts", "acknowledged", "dropped_saves", "gets", "hits", "recomputes", "wrong", "failed"), 0
    ))  # fmt: skip
    slots: list[bytes | None] = [None] * ring
    s = 0

    def timed(op: str, fn: Any) -> Any:
        start = time.time()
        try:
            return fn()
        finally:
            out.calls.append((start - t0, time.time() - start, op))

    while not os.path.exists(stop):
        old = slots[s]
        if old is not None:
            out.live.pop(old, None)
            with contextlib.suppress(KvtierError):
                tier.delete([old])
        key = os.urandom(16)
        out.counts["puts"] += 1
        try:
            ok = timed("put", lambda k=key, b=variants[s]: tier.put([(k, b)])[0])
        except KvtierError:
            ok = False
            time.sleep(0.01)  # as a saver would: no spinning on a skipped tier
        except Exception:
            out.counts["failed"] += 1
            ok = False
        out.counts["acknowledged" if ok else "dropped_saves"] += 1
        slots[s] = key if ok else None
        if ok:
            out.live[key] = digests[s]
        s = (s + 1) % ring
        if not out.live:
            continue
        want_key = list(out.live)[(ci + out.counts["gets"]) % len(out.live)]
        out.counts["gets"] += 1
        try:
            got = timed("get", lambda k=want_key: tier.get([k])[0])
        except KvtierError:
            got = None
            time.sleep(0.01)
        except Exception:
            out.counts["failed"] += 1
            continue
        if got is None:
            out.counts["recomputes"] += 1
        elif xxhash.xxh3_128_intdigest(got) != out.live[want_key]:
            out.counts["wrong"] += 1
        else:
            out.counts["hits"] += 1
    tier.close()
    return out


class _Clients:
    """The store clients of one process (or thread driver), made on first use."""

    def __init__(self) -> None:
        self.by_label: dict[str, LoadClient] = {}
        self.warmed: set[str] = set()  # labels whose client has made its first (untimed) call

    def get(self, group: list[Store]) -> dict[str, LoadClient]:
        for label, spec, _ in group:
            if label not in self.by_label:
                self.by_label[label] = make_client(spec)
        return self.by_label

    def drop(self, label: str) -> None:
        client = self.by_label.pop(label, None)
        self.warmed.discard(label)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()


def _serve(conn: Connection, ci: int, blocks: dict[str, bytes]) -> None:
    clients = _Clients()
    while True:
        msg = conn.recv()
        try:
            if msg[0] == "close":
                for label in list(clients.by_label):
                    clients.drop(label)
                conn.send(None)
                return
            if msg[0] == "phase":
                _, group, op, ops, name, start_at = msg
                conn.send(
                    run_client(
                        clients.get(group),
                        group,
                        op,
                        ops,
                        blocks[name],
                        start_at,
                        ci,
                        clients.warmed,
                    )
                )
            elif msg[0] == "put":
                _, store, keys, name = msg
                client = clients.get([store])[store[0]]
                conn.send([client.put(k, bound_to(blocks[name], k)) for k in keys])
            elif msg[0] == "delete":
                _, store, keys = msg
                client = clients.get([store])[store[0]]
                for k in keys:
                    with contextlib.suppress(Exception):
                        client.delete(k)
                conn.send(None)
            elif msg[0] == "kill_load":
                _, config, name, t0, stop = msg
                conn.send(kill_load(config, blocks[name], ci, t0, stop))
            elif msg[0] == "drop":
                clients.drop(msg[1])
                conn.send(None)
        except Exception as e:  # reported to the parent, which raises it
            conn.send(e)


class WorkerPool:
    """``n`` client processes, forked now, each holding ``blocks`` (name -> object).

    Fork before the parent makes any store client: a forked copy of a live
    client (its tend and pool threads) would not work.
    """

    def __init__(self, n: int, blocks: dict[str, bytes]) -> None:
        ctx = get_context("fork")
        self._conns: list[Connection] = []
        self._procs = []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, i, blocks), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    def _ask(self, conns: list[Connection], msg: tuple[Any, ...]) -> list[Any]:
        for c in conns:
            c.send(msg)
        out = [c.recv() for c in conns]
        for r in out:
            if isinstance(r, Exception):
                raise r
        return out

    def put(self, store: Store, keys: list[bytes], name: str) -> list[bool]:
        return list(self._ask(self._conns[:1], ("put", store, keys, name))[0])

    def phase(
        self, group: list[Store], op: str, clients: int, ops: int, name: str
    ) -> list[dict[str, PhaseResult]]:
        start_at = time.time() + 0.3
        return self._ask(self._conns[:clients], ("phase", group, op, ops, name, start_at))

    def delete(self, store: Store, keys: list[bytes]) -> None:
        self._ask(self._conns[:1], ("delete", store, keys))

    def start_kill_load(
        self, clients: int, config: dict[str, Any], name: str, t0: float, stop: str
    ) -> None:
        """:func:`kill_load` in ``clients`` processes; :meth:`kill_load_results` collects."""
        for c in self._conns[:clients]:
            c.send(("kill_load", config, name, t0, stop))

    def kill_load_results(self, clients: int) -> list[KillLoad]:
        out = [c.recv() for c in self._conns[:clients]]
        for r in out:
            if isinstance(r, Exception):
                raise r
        return out

    def drop(self, label: str) -> None:
        """Every client closes its store client ``label``."""
        self._ask(self._conns, ("drop", label))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ask(self._conns, ("close",))
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.kill()


class ThreadDriver:
    """The calls of :class:`WorkerPool` with clients as threads of this process.

    The threads share one store client per store (Redis: one connection per
    thread), as an engine's load workers share its tier.
    """

    def __init__(self, blocks: dict[str, bytes]) -> None:
        self._clients = _Clients()
        self._blocks = blocks

    def put(self, store: Store, keys: list[bytes], name: str) -> list[bool]:
        client = self._clients.get([store])[store[0]]
        return [client.put(k, bound_to(self._blocks[name], k)) for k in keys]

    def phase(
        self, group: list[Store], op: str, clients: int, ops: int, name: str
    ) -> list[dict[str, PhaseResult]]:
        shared = self._clients.get(group)
        start_at = time.time() + 0.3
        out: list[dict[str, PhaseResult]] = [{} for _ in range(clients)]

        def one(ci: int) -> None:
            out[ci] = run_client(
                shared, group, op, ops, self._blocks[name], start_at, ci, self._clients.warmed
            )

        threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def delete(self, store: Store, keys: list[bytes]) -> None:
        client = self._clients.get([store])[store[0]]
        for k in keys:
            with contextlib.suppress(Exception):
                client.delete(k)

    def drop(self, label: str) -> None:
        self._clients.drop(label)

    def close(self) -> None:
        for label in list(self._clients.by_label):
            self._clients.drop(label)
