"""Sampled verification of hits: recompute a loaded chunk now and then, compare, quarantine.

Checksums and key binding prove that a block is the bytes a writer stored
under its key; they cannot prove that the writer stored the *right KV* — a
buggy or hostile engine that can write to a shared tier encodes wrong
values under the right key, with a valid checksum. Only computing the chunk
again shows that. ``connector.verify_fraction`` = f turns it on::

    prefix found:   [ chunk 0 ][ chunk 1 ][ chunk 2 ][ chunk 3 ][ tail )
    sampled (f):                 ^ first sampled object
    engine:         [ loaded             )[ computed ...........................
    verifier:                              compare chunk 1, 2, 3 and the tail
                                           with their stored blocks

Each loadable object of a request is sampled with probability f (drawn once
per request and object, so a key is checked again on later loads). The load
stops before the first sampled object: a prefix must be contiguous, so the
engine computes it and everything after it, and each of those objects, once
computed, is gathered out of the paged cache (on the step thread, a copy)
and handed to :class:`ChunkVerifier`, whose thread fetches the stored block
and compares. A mismatch is counted, the key deleted from every tier and
held in a bounded :class:`Quarantine` (neither loaded nor saved by this
process for a while) and logged; a cache server among the tiers is told
(``Tier.report_bad``): it deletes the block for every reader and counts it
against the writer that stored it. Cost: a prefix of n chunks recomputes
about f·n(n+1)/2 of them, a fraction f·(n+1)/2 of the loaded tokens.

Comparison (:func:`compare_chunk`): the relative RMS error of every
(layer, K/V) plane, ‖computed − stored‖₂ / ‖computed‖₂, against a tolerance
per stored encoding (:func:`tolerance`). NOTE: an element-wise quantization
bound is not enough for int8/fp8: the engine computes the sampled chunk on
top of *dequantized* earlier chunks, so layers past the first drift from the
values the writer quantized. Measured by ``bench/verify_drift.py`` (SmolLM2-135M
bf16, 4 chunks of 256 + 5 tokens, every split point): raw recompute is
bit-exact on this engine's CPU path (error 0); int8 ≤ 2.7 %, fp8_e4m3 ≤ 5.2 %
per plane. The tolerances leave 3.7x of margin over that; KV of other tokens
or positions is off by ~100 %. A raw block another engine's kernels computed
is not bit-exact (bf16 vLLM-CPU: up to 2.2 %; float32: 2.25e-6): raw allows
10 epsilons, and never less than 1e-4.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.block import BlockSpec, Encoding, decode_block
from kvtier.connectors.queue_worker import QueueWorker
from kvtier.errors import CorruptBlockError, KvtierError
from kvtier.kernels import dequantize_chunk
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore

log = logging.getLogger(__name__)

QUARANTINE_KEYS = 4096
"""Keys a quarantine remembers (16 bytes each); the oldest is forgotten first."""

QUARANTINE_S = 3600.0
"""How long a quarantined key is neither loaded nor saved by this process."""

# Relative RMS error allowed per (layer, K/V) plane, by stored encoding (module docstring).
_QUANTIZED_TOLERANCE = {Encoding.INT8: 0.10, Encoding.FP8_E4M3: 0.20}

Sampler = Callable[[bytes], bool]
"""Decides, for one loadable object's key, whether it is verified this time."""

_RECENT = 256


RAW_DRIFT_EPS = 10.0
"""Machine epsilons of the KV dtype a correct raw block may differ from its recompute by."""

RAW_DRIFT_FLOOR = 1e-4
"""Relative RMS error a correct raw block may always differ by, whatever the dtype's epsilon."""


def tolerance(encoding: Encoding, kv_dtype: torch.dtype) -> float:
    """The relative RMS error per (layer, K/V) plane a correct block stays within.

    Raw: ``RAW_DRIFT_EPS`` (10) machine epsilons of the KV dtype (bfloat16 7.8 %,
    float16 0.98 %), and never under ``RAW_DRIFT_FLOOR`` (1e-4, what float32
    gets). A recompute on the same engine's path is
    bit-exact (``bench/verify_drift.py``), but a block another engine wrote —
    another process, batch or chunk split; vLLM-CPU computes a chunk on top of
    a cached prefix in another accumulation order than a whole prefill — differs
    by rounding that compounds over the layers: 1.2-2.2 % at layer 19 V in bf16
    between two vLLM-CPU 0.32 engines (the warm-start bench's joiner: 1.6-2.8
    epsilons; at the former tolerance of one epsilon it deleted four good
    blocks from the shared tier). Ten leave 3.5x over that, as the quantized
    encodings' tolerances do over their drift; KV of other tokens or positions
    is off by ~100 %. The drift does not scale with the epsilon: between two
    float32 vLLM-CPU engines (the same bench, a host without native bf16) it was
    1.85-2.25e-6 at layer 19 V, 15-19 float32 epsilons, and ten had deleted those
    good blocks from the shared tier; a bf16 plane rounds such differences away
    or makes them a whole bf16 step. The floor leaves 44x over that and is
    still 10,000x under KV of other tokens. float16: scaled, not measured.
    int8: 10 %, fp8_e4m3: 20 % (quantization plus drift; module docstring).
    """
    if encoding == Encoding.RAW:
        return max(RAW_DRIFT_EPS * float(torch.finfo(kv_dtype).eps), RAW_DRIFT_FLOOR)
    return _QUANTIZED_TOLERANCE[encoding]


def random_sampler(fraction: float, rng: random.Random | None = None) -> Sampler:
    """Samples each key with probability ``fraction`` (``rng``: seeded for reproducible runs)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"verify fraction must be within [0, 1], got {fraction}")
    draw = (rng or random.Random()).random
    return lambda _key: draw() < fraction


@dataclass(frozen=True)
class Verdict:
    """One comparison: the worst (layer, K/V) plane and whether it is within tolerance."""

    ok: bool
    error: float  # relative RMS error of the worst plane (inf: not comparable)
    tolerance: float
    layer: int = -1
    kv: int = -1  # 0 K, 1 V
    reason: str = ""

    def describe(self) -> str:
        """A one-line account for logs."""
        if self.reason:
            return self.reason
        if self.layer < 0:
            return "identical"
        plane = f"layer {self.layer} {'KV'[self.kv]}"
        return f"relative RMS error {self.error:.3g} at {plane} (tolerance {self.tolerance:.3g})"


def compare_chunk(computed: torch.Tensor, block: bytes, key: bytes, spec: BlockSpec) -> Verdict:
    """Compares KV the engine computed with the block stored under ``key``.

    Args:
        computed: ``[layers, 2, tokens, kv_heads, head_dim]`` in the engine's KV dtype.
        block: The stored block.
        key: Its key (a block that carries another key does not match).
        spec: The engine's KV layout.
    """
    try:
        stored = decode_block(block, key=key, expect=spec, verify=False)
    except CorruptBlockError as e:
        return Verdict(False, float("inf"), 0.0, reason=f"stored block does not decode: {e}")
    h = stored.header
    tol = tolerance(h.encoding, spec.kv_dtype)
    if h.shape != tuple(computed.shape):
        return Verdict(
            False, float("inf"), tol, reason=f"stored shape {h.shape} != computed {computed.shape}"
        )
    if stored.scales is None:
        values = stored.payload
    else:
        values = dequantize_chunk(stored.payload, stored.scales, torch.float32)
    worst = Verdict(True, 0.0, tol)
    for layer in range(computed.shape[0]):  # a layer at a time: float32 temporaries stay small
        c = computed[layer].to(torch.float32)  # [2, T, H, D]
        diff = torch.linalg.vector_norm(
            c - values[layer].float(), dim=(1, 2, 3), dtype=torch.float64
        )
        norm = torch.linalg.vector_norm(c, dim=(1, 2, 3), dtype=torch.float64)
        for kv in range(2):
            d, n = float(diff[kv]), float(norm[kv])
            err = d / n if n > 0 else (0.0 if d == 0 else float("inf"))
            if err > worst.error:
                worst = Verdict(err <= tol, err, tol, layer, kv)
    return worst


class Quarantine:
    """Keys found wrong: neither loaded nor saved until they expire. Thread-safe.

    Args:
        max_keys: Keys held; adding one more forgets the oldest.
        ttl_s: Seconds a key stays.
        clock: ``time.monotonic`` (replaceable in tests).
    """

    def __init__(
        self,
        max_keys: int = QUARANTINE_KEYS,
        ttl_s: float = QUARANTINE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_keys < 1 or ttl_s <= 0:
            raise ValueError(
                f"quarantine needs max_keys >= 1 and ttl_s > 0, got {max_keys}, {ttl_s}"
            )
        self._max = max_keys
        self._ttl = ttl_s
        self._clock = clock
        self._until: OrderedDict[bytes, float] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def add(self, key: bytes) -> None:
        """Quarantines ``key`` (again: its time starts over)."""
        with self._lock:
            self._until.pop(key, None)
            self._until[key] = self._clock() + self._ttl
            while len(self._until) > self._max:
                self._until.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            until = self._until.get(key)  # type: ignore[call-overload]
            if until is None:
                return False
            if self._clock() < until:
                return True
            del self._until[key]  # type: ignore[arg-type]
            return False

    @property
    def ttl_s(self) -> float:
        """Seconds a key stays."""
        return self._ttl

    def __len__(self) -> int:
        with self._lock:
            now = self._clock()
            return sum(1 for t in self._until.values() if now < t)


@dataclass
class VerifyStats:
    """What the verifier did (the metric ``kvtier_verify_checks_total`` counts the same)."""

    matched: int = 0
    mismatched: int = 0
    missing: int = 0  # the block was gone (evicted, deleted) by the time it was compared
    errors: int = 0  # the store could not be read
    dropped: int = 0  # the queue was full


@dataclass(frozen=True)
class _Check:
    key: bytes
    computed: torch.Tensor


class ChunkVerifier(QueueWorker[_Check]):
    """Fetches stored blocks and compares them with computed chunks, on its own thread.

    Args:
        store: Where the blocks are (and where a wrong one is deleted).
        spec: The engine's KV layout.
        quarantine: Where wrong keys go.
        metrics: ``kvtier_verify_checks_total``.
        max_queue: Chunks waiting to be compared; more are dropped (counted).
        fetch_timeout_s: Deadline of one block's fetch.
        on_mismatch: Told each key found wrong (on the verifier's thread), after
            it was deleted and quarantined.
    """

    def __init__(
        self,
        store: TieredStore,
        *,
        spec: BlockSpec,
        quarantine: Quarantine,
        metrics: StoreMetrics,
        max_queue: int,
        fetch_timeout_s: float,
        on_mismatch: Callable[[bytes], None] | None = None,
    ) -> None:
        self._on_mismatch = on_mismatch
        self._store = store
        self._spec = spec
        self._quarantine = quarantine
        self._metrics = metrics
        self._timeout = fetch_timeout_s
        self.stats = VerifyStats()
        self.recent: deque[tuple[bytes, Verdict]] = deque(maxlen=_RECENT)
        """The last comparisons, newest last (for logs, benchmarks and tests)."""
        super().__init__("kvtier-verify", max_queue)

    def submit(self, key: bytes, computed: torch.Tensor) -> bool:
        """Queues a computed chunk (a CPU copy the caller no longer writes) for comparison."""
        if self._offer(_Check(key, computed)):
            return True
        self._count("dropped")
        return False

    def _count(self, outcome: str) -> None:
        field = {
            "match": "matched",
            "mismatch": "mismatched",
            "missing": "missing",
            "error": "errors",
            "dropped": "dropped",
        }[outcome]
        setattr(self.stats, field, getattr(self.stats, field) + 1)
        self._metrics.verify_checks.labels(outcome).inc()

    def _handle(self, item: _Check) -> None:
        try:
            block = self._store.get([item.key], deadline=time.monotonic() + self._timeout)[0]
        except KvtierError as e:  # the store turns tier failures into misses; this is a bug guard
            log.warning("kvtier verifier: cannot read %s: %s", item.key.hex(), e)
            self._count("error")
            return
        if block is None:
            self._count("missing")
            return
        with self._metrics.time_stage("verify"):
            verdict = compare_chunk(item.computed, block, item.key, self._spec)
        self.recent.append((item.key, verdict))
        if verdict.ok:
            self._count("match")
            return
        self._count("mismatch")
        self._quarantine.add(item.key)
        # every tier of this store; a shared one (the cache server) deletes it for everyone
        # and counts it against its writer
        self._store.discard_bad([item.key])
        if self._on_mismatch is not None:
            self._on_mismatch(item.key)
        log.warning(
            "kvtier verifier: stored block %s does not match the recomputed KV (%s); deleted "
            "from every tier and quarantined for %.0f s (a block loaded before it can also "
            "cause this)",
            item.key.hex(),
            verdict.describe(),
            self._quarantine.ttl_s,
        )

    def _failed(self, item: _Check, error: Exception) -> None:
        log.warning("kvtier verifier: check failed: %s", error)  # a torch failure: one check lost
        self._count("error")
