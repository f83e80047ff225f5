"""A real Aerospike cluster losing a node while engines load and save through the tier.

The test run's cluster (tests/support/aerospike_target.py: two ``asd`` nodes
on 127.0.0.1 started from ``../shared/aerospike``, replication-factor 2, the
namespace of ``deploy/aerospike/aerospike.conf``). One node is killed
(SIGKILL: its in-memory data is gone), restarted, rejoins and migrates; or
paused (SIGSTOP) longer than the tier's timeouts. What must hold:

* nothing acknowledged is lost: every block whose ``put`` answered ``True``
  reads back byte-identical, from the replica while the node is down and
  from the restarted node once migrations are done;
* nothing wrong is served: every engine answer equals the answer of an
  engine without kvtier;
* no inference request fails: a load that cannot complete is a counted
  recompute (``load_failures``), a save that cannot land a counted drop;
* the breaker and the read deadline behave as docs/aerospike.md says.

Each test leaves the cluster whole (every node up, migrations done).
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aerospike
import pytest
import torch

from kvtier.breaker import BreakerState
from kvtier.config import KvtierConfig
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine import LLM, SamplingParams
from kvtier.errors import TierUnavailableError, TransientError
from kvtier.tiers.aerospike import AerospikeTier
from kvtier.tiers.aerospike_config import AerospikeTierConfig
from tests.engine.tiny_models import write_tiny_model
from tests.support.aerospike_cluster import AerospikeCluster, deploy_settings
from tests.support.aerospike_target import CLUSTER, Target, backend, make_target, session_cluster
from tests.support.timeouts import aerospike_timeouts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        backend() != CLUSTER,
        reason="starts, kills and pauses nodes: needs ../shared/aerospike",
    ),
]

CHUNK = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cluster() -> Iterator[AerospikeCluster]:
    c = session_cluster()
    c.heal()
    yield c
    c.heal()  # whatever the test did, the next one gets the whole cluster back


@pytest.fixture
def target(cluster: AerospikeCluster) -> Iterator[Target]:
    t = make_target()
    yield t
    t.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny-cluster"), "llama", seed=5)
    return path


def tier_config(cluster: AerospikeCluster, target: Target, **kw: Any) -> dict[str, Any]:
    return {
        "type": "aerospike",
        "hosts": cluster.seeds,
        "namespace": target.namespace,
        "set_name": target.set_name,
        "cluster_name": cluster.settings.cluster_name,
        "ttl_s": 3600,
        **aerospike_timeouts(),
        **kw,
    }


class Acks:
    """Every block a tier acknowledged (``put`` answered ``True``), by key: its SHA-256."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def watch(self, tier: AerospikeTier) -> None:
        put = tier.put

        def recording(items: Any) -> list[bool]:
            items = list(items)
            done = put(items)
            with self._lock:
                for (key, block), ok in zip(items, done, strict=True):
                    if ok:
                        self.blocks[key] = hashlib.sha256(block).digest()
            return done

        tier.put = recording  # type: ignore[method-assign]

    def check(self, reader: AerospikeTier) -> tuple[int, int]:
        """(lost, wrong) of every acknowledged block, read through ``reader``."""
        keys = list(self.blocks)
        got = reader.get(keys)
        lost = sum(g is None for g in got)
        wrong = sum(
            g is not None and hashlib.sha256(g).digest() != self.blocks[k]
            for k, g in zip(keys, got, strict=True)
        )
        return lost, wrong


def engine(tiny: Path, tier: dict[str, Any], acks: Acks) -> tuple[KvtierConnector, LLM]:
    """An engine whose only kvtier tier is the cluster (every load comes from Aerospike)."""
    cfg = KvtierConfig.model_validate(
        {
            "chunk_size": CHUNK,
            "tiers": [tier],
            "connector": {"min_load_tokens": CHUNK, "load_timeout_s": 5.0, "verify_fraction": 0},
        }
    )
    conn = KvtierConnector(config=cfg)
    (aero,) = conn.store.tiers
    assert isinstance(aero, AerospikeTier)
    acks.watch(aero)
    llm = LLM(
        str(tiny),
        dtype="float32",
        device="cpu",
        block_size=16,
        num_threads=1,
        connector=conn,
        enable_prefix_caching=False,
    )
    return conn, llm


def prompts(n: int, seed: int, length: int = 4 * CHUNK + 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 380, (length,), generator=g).tolist() for _ in range(n)]


def cold_answers(tiny: Path, ps: list[list[int]]) -> list[list[int]]:
    plain = LLM(str(tiny), dtype="float32", device="cpu", block_size=16, num_threads=1)
    try:
        return [o.token_ids for o in plain.generate(ps, GREEDY)]
    finally:
        plain.engine.shutdown()


def reader_tier(
    cluster: AerospikeCluster,
    target: Target,
    seed: str,
    clock: Callable[[], float] = time.monotonic,
    **kw: Any,
) -> AerospikeTier:
    """A tier of its own on the cluster, seeded with one node only."""
    cfg = tier_config(cluster, target, **kw)
    cfg["hosts"] = [seed]
    cfg.pop("type")
    return AerospikeTier(AerospikeTierConfig(**cfg), clock=clock)


def masters(cluster: AerospikeCluster, node: int) -> set[int]:
    """Partitions node ``node`` masters (its ``replicas`` info: one bitmap per copy)."""
    reply = cluster.info(node, "replicas")
    for part in reply.split(";"):
        name, _, rest = part.partition(":")
        if name == cluster.namespace:
            bitmap = base64.b64decode(rest.split(",")[2])
            return {p for p in range(4096) if bitmap[p >> 3] & (0x80 >> (p & 7))}
    raise AssertionError(f"no {cluster.namespace} in {reply!r}")


def key_on(partitions: set[int], target: Target) -> bytes:
    """A fresh chunk key whose record lives in one of ``partitions``."""
    while True:
        key = os.urandom(16)
        digest = aerospike.calc_digest(target.namespace, target.set_name, bytearray(key))
        if (digest[0] | digest[1] << 8) & 4095 in partitions:
            return key


# --------------------------------------------------------------------------------------------


def test_the_cluster_runs_the_deployed_namespace(cluster: AerospikeCluster) -> None:
    """docker-compose runs deploy/aerospike/aerospike.conf; every node here reports its settings."""
    deployed = deploy_settings()
    expected = deployed.expected_info()
    assert expected["replication-factor"] == "2"
    assert deployed.service  # e.g. batch-max-buffers-per-queue
    for i in range(cluster.nodes):
        live = cluster.namespace_info(i)
        assert {k: live.get(k) for k in expected} == expected
        service = cluster.service_config(i)
        assert {k: service.get(k) for k in deployed.service} == deployed.service
        assert live["effective_replication_factor"] == "2"
        assert cluster.info(i, "cluster-name") == deploy_settings().cluster_name
        assert cluster.cluster_size(i) == cluster.nodes


def test_a_node_killed_while_engines_load_and_save(
    cluster: AerospikeCluster, target: Target, tiny: Path
) -> None:
    stored, fresh = prompts(4, seed=1), prompts(4, seed=2)
    cold = cold_answers(tiny, stored + fresh)
    acks = Acks()
    tier = tier_config(cluster, target)
    writer_conn, writer = engine(tiny, tier, acks)
    reader_conn, reader = engine(tiny, tier, acks)
    try:
        assert [o.token_ids for o in writer.generate(stored, GREEDY)] == cold[:4]
        assert writer_conn.flush()
        assert len(acks.blocks) >= 4 * 4  # 4 full chunks per prompt (and its tail)
        # The reader loads the stored prompts and saves fresh ones, one request at a time;
        # node 1 dies (SIGKILL) after its first request.
        work = [p for pair in zip(stored, fresh, strict=True) for p in pair]
        answers: list[list[int]] = []
        first = threading.Event()

        def serve() -> None:
            for p in work:
                answers.append(reader.generate([p], GREEDY)[0].token_ids)
                first.set()

        # NOTE: made before the kill: a client that starts while a dead node is still a
        # member (~2 s) fails to connect ("Peers not reachable") and its breaker waits.
        check = reader_tier(cluster, target, cluster.seeds[0])
        thread = threading.Thread(target=serve)
        thread.start()
        assert first.wait(120)
        cluster.kill(1)
        assert acks.check(check) == (0, 0)  # read from the replica while node 1 is down
        thread.join(120)
        assert not thread.is_alive()
        expected = [a for pair in zip(cold[:4], cold[4:], strict=True) for a in pair]
        assert answers == expected  # nothing wrong served, no request failed
        stats = reader_conn.stats
        assert stats.loaded_tokens > 0
        # a load that could not complete was recomputed, and counted
        failed = reader_conn.metrics.value("kvtier_load_tokens_total", {"outcome": "failed"})
        assert failed == stats.failed_tokens
        print(
            f"after the kill: {stats.loaded_tokens} tokens loaded, {stats.load_failures} loads recomputed"
        )
        assert reader_conn.flush()

        cluster.restart(1)  # back empty; rejoins; start-node.sh waits for migrations
        only_restarted = reader_tier(cluster, target, cluster.seeds[1])
        cluster.kill(0)  # now only the restarted node holds the data: migration filled it
        assert acks.check(only_restarted) == (0, 0)
        only_restarted.close()
        check.close()
        cluster.heal()

        # Whole again: the reader answers as before and loads every prompt the writer stored.
        loaded_before = reader_conn.stats.loaded_tokens
        assert [o.token_ids for o in reader.generate(stored + fresh, GREEDY)] == cold
        assert reader_conn.stats.loaded_tokens - loaded_before >= 4 * (len(stored[0]) - 1)
    finally:
        for llm in (writer, reader):
            llm.engine.shutdown()
        for conn in (writer_conn, reader_conn):
            conn.shutdown()


def test_a_node_paused_longer_than_the_tier_timeouts(
    cluster: AerospikeCluster, target: Target, tiny: Path
) -> None:
    # Timeouts far below the pause (4 s): socket 200 ms, reads 1 s, writes 300 ms.
    timeouts = {
        "socket_timeout_ms": 200,
        "total_timeout_ms": 1000,
        "write_timeout_ms": 300,
        "max_retries": 0,
    }
    stored, fresh = prompts(3, seed=3), prompts(3, seed=4)
    cold = cold_answers(tiny, stored + fresh)
    acks = Acks()
    writer_conn, writer = engine(tiny, tier_config(cluster, target), acks)
    reader_conn, reader = engine(tiny, tier_config(cluster, target, **timeouts), acks)
    clock = FakeClock()
    # NOTE: every client is made before the pause: a new client would wait its connect
    # timeout for the paused node while it learns the cluster.
    probe = reader_tier(
        cluster,
        target,
        cluster.address,
        clock,
        breaker_threshold=1,
        breaker_cooldown_s=1,
        skip_existing=False,
        **timeouts,
    )
    check = reader_tier(cluster, target, cluster.address, **timeouts)
    try:
        assert [o.token_ids for o in writer.generate(stored, GREEDY)] == cold[:3]
        assert writer_conn.flush()
        on_paused = set(range(4096)) - masters(cluster, 0)  # node 1's partitions
        mine = key_on(on_paused, target)
        assert probe.put([(mine, b"m" * 1000)]) == [True]

        # Every call below returns while node 1 is stopped: it is resumed only at the end.
        cluster.pause(1)
        # First (the cluster drops the node after ~1.5 s, then its partitions move): a write
        # to the paused master fails by the tier's timeout and, with a threshold of 1, opens
        # the breaker of writes; the next write is skipped without network I/O ...
        with pytest.raises(TransientError):
            probe.put([(key_on(on_paused, target), b"w" * 1000)])
        assert probe.write_breaker.state is BreakerState.OPEN
        trips = probe.stats().round_trips
        with pytest.raises(TierUnavailableError):
            probe.put([(os.urandom(16), b"w" * 1000)])
        assert probe.stats().round_trips == trips and probe.stats().skipped_calls == 1
        # ... while reads go on: they fail over to the replica within one attempt, the right
        # bytes by the deadline, and their breaker stays closed.
        assert probe.get([mine], deadline=time.monotonic() + 0.5) == [b"m" * 1000]
        assert probe.breaker.state is BreakerState.CLOSED
        assert acks.check(check) == (0, 0)
        # Engines keep answering: loads come from the replica or are recomputed, saves that
        # cannot land are dropped and counted.
        work = [p for pair in zip(stored, fresh, strict=True) for p in pair]
        answers = [reader.generate([p], GREEDY)[0].token_ids for p in work]
        expected = [a for pair in zip(cold[:3], cold[3:], strict=True) for a in pair]
        assert answers == expected
        assert reader_conn.flush()

        cluster.resume(1)
        cluster.wait_stable(cluster.nodes)  # rejoined (if it was dropped), migrations done
        clock.now += 1  # the cool-down is over: the next write is the probe, and it lands
        assert probe.put([(key_on(on_paused, target), b"w" * 1000)]) == [True]
        assert probe.write_breaker.state is BreakerState.CLOSED
        assert acks.check(check) == (0, 0)
        assert [o.token_ids for o in reader.generate(stored, GREEDY)] == cold[:3]
    finally:
        probe.close()
        check.close()
        for llm in (writer, reader):
            llm.engine.shutdown()
        for conn in (writer_conn, reader_conn):
            conn.shutdown()
