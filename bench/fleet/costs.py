"""Cost model of one engine and of the shared tier, and the profiles that set its constants.

An engine step costs (continuous batching: prefill chunks and decodes in one
flat batch, as in ``engine/scheduler.py``)::

    step_s = base + a·prefill_tokens + b·attention_pairs + s·decode_seqs + c·decode_context_tokens

``attention_pairs`` of a prefill chunk of ``n`` tokens after ``p`` computed
ones is ``n·p + n·(n+1)/2``: the linear term is the matmuls, the quadratic one
attention. A load from the shared tier costs ``latency + bytes / bandwidth``.

Profiles:

* ``cpu-smollm2`` — *measured*: base, a, b, s fitted to the figures of
  ``bench/RESULTS.md`` (``bench/engine.py --quick``, SmolLM2-135M bf16, 2
  threads); c measured with ``bench/fleet_calibrate.py``; KV bytes and G1
  capacity from the engine's layout; tier link from ``bench/ttft.py``'s load
  bandwidth. The tier's aggregate bandwidth, latency and capacity are
  *assumed*. docs/fleet.md lists every figure.
* ``gpu-8b`` — *assumed* throughout (no GPU measurement exists in this
  project): an 8B Llama-3-shaped model in bf16 on one H100-class GPU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

TERMS = ("base_s", "prefill_s_per_token", "attn_s_per_pair", "decode_s_per_seq", "decode_s_per_ctx")


def chunk_pairs(start: int, n: int) -> int:
    """Attention (query, key) pairs of ``n`` new tokens after ``start`` computed ones."""
    return n * start + n * (n + 1) // 2


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one engine step, by term (see the module docstring).

    Attributes:
        base_s: Fixed cost of any step (reading the weights, launching work).
        prefill_s_per_token: Per prompt token computed (matmuls).
        attn_s_per_pair: Per (query, key) pair of prefill attention.
        decode_s_per_seq: Per decoding sequence in the batch.
        decode_s_per_ctx: Per context token of the decoding sequences (reading their KV).
    """

    base_s: float
    prefill_s_per_token: float
    attn_s_per_pair: float
    decode_s_per_seq: float
    decode_s_per_ctx: float

    def __post_init__(self) -> None:
        for name in TERMS:
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and >= 0, got {v}")

    def step_s(self, prefill_tokens: int, pairs: int, decode_seqs: int, decode_ctx: int) -> float:
        """Seconds of one step of this shape."""
        return (
            self.base_s
            + self.prefill_s_per_token * prefill_tokens
            + self.attn_s_per_pair * pairs
            + self.decode_s_per_seq * decode_seqs
            + self.decode_s_per_ctx * decode_ctx
        )

    def compute_s(self, start: int, n: int) -> float:
        """Matmul and attention seconds of ``n`` prompt tokens after ``start`` (no step base)."""
        return self.prefill_s_per_token * n + self.attn_s_per_pair * chunk_pairs(start, n)

    def prefill_floor_s(self, start: int, n: int, budget: int) -> float:
        """The least time ``n`` uncached tokens after ``start`` can take: their compute plus
        one step base per chunk of at most ``budget`` tokens."""
        return math.ceil(n / budget) * self.base_s + self.compute_s(start, n)


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its step costs and the limits of its scheduler and KV memory (G1).

    Attributes:
        costs: Step cost model.
        kv_bytes_per_token: KV bytes of one token over all layers (K and V).
        g1_capacity_tokens: Tokens the engine's own KV memory holds.
        block_tokens: Tokens per KV block (G1 hits are whole blocks).
        max_batched_tokens: Token budget of one step (prefill chunks + decodes).
        max_num_seqs: Most requests admitted at once (running, prefilling or loading).
    """

    costs: StepCosts
    kv_bytes_per_token: int
    g1_capacity_tokens: int
    block_tokens: int = 16
    max_batched_tokens: int = 2048
    max_num_seqs: int = 16

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0 or self.block_tokens <= 0:
            raise ValueError("kv_bytes_per_token and block_tokens must be > 0")
        if self.g1_capacity_tokens < self.block_tokens * 2:
            raise ValueError("g1_capacity_tokens must hold at least two blocks")
        if self.max_batched_tokens <= self.max_num_seqs:
            raise ValueError("max_batched_tokens must exceed max_num_seqs (decodes always fit)")

    @property
    def g1_capacity_blocks(self) -> int:
        """G1 capacity in blocks."""
        return self.g1_capacity_tokens // self.block_tokens


@dataclass(frozen=True)
class TierSpec:
    """The shared KV tier (G2-G4 seen from the fleet) and the engines' links to it.

    Attributes:
        aggregate_gbps: What the whole tier serves, reads and writes together (GB/s).
        link_gbps: One engine's link to the tier, including placing KV in its cache (GB/s).
        latency_s: Fixed cost of each transfer (lookup and round trip).
        capacity_gb: Tier capacity (LRU over chunks).
        chunk_tokens: Tokens per stored object; tier hits are whole chunks.
        min_load_tokens: A tier hit shorter than this is recomputed instead (kvtier's default).
    """

    aggregate_gbps: float
    link_gbps: float
    latency_s: float
    capacity_gb: float
    chunk_tokens: int = 256
    min_load_tokens: int = 256

    def __post_init__(self) -> None:
        if self.aggregate_gbps <= 0 or self.link_gbps <= 0 or self.capacity_gb <= 0:
            raise ValueError("tier bandwidths and capacity must be > 0 (inf allowed)")
        if self.latency_s < 0 or self.chunk_tokens <= 0 or self.min_load_tokens < 0:
            raise ValueError("latency_s, min_load_tokens must be >= 0 and chunk_tokens > 0")


@dataclass(frozen=True)
class Profile:
    """Named constants for a fleet: engine, tier, default load and where each figure came from.

    Attributes:
        name: Profile name (``--profile``).
        engine: Engine constants.
        tier: Tier constants.
        session_rate_per_engine: Default new sessions per second per engine.
        answer_tokens: Default (min, max) answer length of the workload.
        sources: Constant name -> where its value comes from ("measured: ..." or "assumed: ...").
    """

    name: str
    engine: EngineSpec
    tier: TierSpec
    session_rate_per_engine: float
    answer_tokens: tuple[int, int]
    sources: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StepFigure:
    """A timed step of known shape, the input of :func:`fit_step_costs`."""

    label: str
    source: str
    prefill_tokens: int
    pairs: int
    decode_seqs: int
    decode_ctx: int
    seconds: float
    steps: int = 1

    def features(self) -> list[float]:
        """The fit's columns, in :data:`TERMS` order."""
        return [self.steps, self.prefill_tokens, self.pairs, self.decode_seqs, self.decode_ctx]


def fit_step_costs(
    figures: Sequence[StepFigure], fixed: Mapping[str, float] | None = None
) -> StepCosts:
    """Least-squares fit of :class:`StepCosts` to timed steps, by relative error.

    Terms in ``fixed`` are not fitted; a term that fits negative is pinned at 0.
    """
    fixed = dict(fixed or {})
    x = np.array([f.features() for f in figures], dtype=float)
    y = np.array([f.seconds for f in figures], dtype=float)
    known = np.array([fixed.get(t, 0.0) for t in TERMS])
    rest = y - x @ known
    w = 1.0 / y  # NOTE: relative error, so 40 ms decode steps weigh as much as 2 s prefills
    active = [i for i, t in enumerate(TERMS) if t not in fixed]
    coef = np.zeros(0)
    while active:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], rest * w, rcond=None)
        negative = {active[i] for i, c in enumerate(coef) if c < 0}
        if not negative:
            break
        active = [i for i in active if i not in negative]
    values = known.copy()
    values[active] = coef[: len(active)]
    return StepCosts(*(float(v) for v in values))


# ---- cpu-smollm2: measured ---------------------------------------------------------------

_ENGINE_PY = "bench/RESULTS.md, bench/engine.py --quick (bf16, 2 threads, wall clock)"

#: The figures ``cpu-smollm2``'s base, a, b, s are fitted to.
CPU_SMOLLM2_FIGURES = (
    StepFigure("prefill 512: 2,883 tok/s", _ENGINE_PY, 512, chunk_pairs(0, 512), 0, 0, 512 / 2883),
    StepFigure(
        "prefill 2048: 2,412 tok/s", _ENGINE_PY, 2048, chunk_pairs(0, 2048), 0, 0, 2048 / 2412
    ),
    StepFigure(
        "prefill 4096 (two 2,048-token steps): 1,709 tok/s",
        _ENGINE_PY,
        4096,
        chunk_pairs(0, 2048) + chunk_pairs(2048, 2048),
        0,
        0,
        4096 / 1709,
        steps=2,
    ),
    # bench/engine.py decodes 128-token prompts: contexts ~129-145 tokens each.
    StepFigure("decode b1: 25.3 tok/s", _ENGINE_PY, 0, 0, 1, 137, 1 / 25.3),
    StepFigure("decode b8: 171 tok/s", _ENGINE_PY, 0, 0, 8, 8 * 137, 8 / 171),
)
#: Per context token of a decode step: bench/fleet_calibrate.py's decode rows on this host
#: (the C paged-decode kernel reading K/V in place; docs/fleet.md).
CPU_SMOLLM2_DECODE_S_PER_CTX = 1.21e-6
#: SmolLM2-135M: 30 layers x 2 (K, V) x 3 KV heads x 64 x 2 bytes (bf16).
CPU_SMOLLM2_KV_BYTES = 30 * 2 * 3 * 64 * 2
#: The engine's default kv_cache_memory (512 MiB) in 16-token blocks of that size.
CPU_SMOLLM2_G1_TOKENS = (512 * 2**20 // (CPU_SMOLLM2_KV_BYTES * 16)) * 16


def cpu_smollm2() -> Profile:
    """SmolLM2-135M on a 2-core CPU, from this project's measurements (docs/fleet.md)."""
    costs = fit_step_costs(
        CPU_SMOLLM2_FIGURES, fixed={"decode_s_per_ctx": CPU_SMOLLM2_DECODE_S_PER_CTX}
    )
    engine = EngineSpec(
        costs=costs,
        kv_bytes_per_token=CPU_SMOLLM2_KV_BYTES,
        g1_capacity_tokens=CPU_SMOLLM2_G1_TOKENS,
        block_tokens=16,
        max_batched_tokens=2048,
        max_num_seqs=16,
    )
    tier = TierSpec(
        aggregate_gbps=10.0, link_gbps=3.0, latency_s=0.001, capacity_gb=1000.0, chunk_tokens=256
    )
    sources = {
        "base_s, prefill_s_per_token, attn_s_per_pair, decode_s_per_seq": (
            "measured: fitted to "
            + "; ".join(f.label for f in CPU_SMOLLM2_FIGURES)
            + f" ({_ENGINE_PY})"
        ),
        "decode_s_per_ctx": "measured: bench/fleet_calibrate.py --threads 1 --clock cpu, decode rows",
        "kv_bytes_per_token": "measured: SmolLM2-135M layout, 30x2x3x64 bf16 = 23,040 B",
        "g1_capacity_tokens": "measured: engine default kv_cache_memory 512 MiB",
        "block_tokens, max_batched_tokens, max_num_seqs": "engine defaults (EngineConfig)",
        "tier.link_gbps": "measured: bench/ttft.py load bandwidth 2.95-3.26 GB/s (raw, CPU tier)",
        "tier.aggregate_gbps": "assumed: 10 GB/s (a few cache servers at ~1.8 GB/s each)",
        "tier.latency_s": "assumed: 1 ms per transfer (lookup + network round trip)",
        "tier.capacity_gb": "assumed: 1,000 GB",
        "tier.chunk_tokens, min_load_tokens": "kvtier defaults (256, 256)",
        "session_rate_per_engine": "chosen: engines about half busy (colocated, round_robin)",
    }
    return Profile("cpu-smollm2", engine, tier, 0.12, (16, 128), sources)


# ---- gpu-8b: assumed ---------------------------------------------------------------------


def gpu_8b() -> Profile:
    """An 8B Llama-3-shaped model, bf16, one H100-class GPU per engine: ASSUMED constants.

    Nothing here was measured in this project; the figures are round numbers
    from first principles (16 GB of weights read per step at ~2.5 TB/s, ~16
    GFLOP per prompt token at ~350 TFLOP/s effective) to show the shape of
    the answer on a GPU fleet. Replace them with ``bench/fleet_calibrate.py``
    output from a real GPU run (``--calibration``).
    """
    kv_bytes = 32 * 2 * 8 * 128 * 2  # Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, bf16
    costs = StepCosts(
        base_s=0.008,
        prefill_s_per_token=45e-6,
        attn_s_per_pair=1.7e-9,
        decode_s_per_seq=50e-6,
        decode_s_per_ctx=5.5e-8,
    )
    engine = EngineSpec(
        costs=costs,
        kv_bytes_per_token=kv_bytes,
        g1_capacity_tokens=400_000,
        block_tokens=16,
        max_batched_tokens=8192,
        max_num_seqs=128,
    )
    tier = TierSpec(aggregate_gbps=400.0, link_gbps=12.5, latency_s=0.001, capacity_gb=20_000.0)
    sources = {
        "base_s": "assumed: 8 ms (16 GB of weights at ~2.5 TB/s, plus launches)",
        "prefill_s_per_token": "assumed: 45 us (~16 GFLOP/token at ~350 TFLOP/s)",
        "attn_s_per_pair": "assumed: 1.7 ns (~0.5 MFLOP per pair)",
        "decode_s_per_seq": "assumed: 50 us",
        "decode_s_per_ctx": "assumed: 55 ns (131 KB of KV per token at ~2.4 TB/s)",
        "kv_bytes_per_token": "computed: 32x2x8x128 bf16 = 131,072 B",
        "g1_capacity_tokens": "assumed: 400k tokens (~52 GB of an 80 GB GPU)",
        "max_batched_tokens, max_num_seqs": "assumed: 8192, 128",
        "tier.link_gbps": "assumed: 12.5 GB/s (100 Gb/s NIC per engine)",
        "tier.aggregate_gbps": "assumed: 400 GB/s",
        "tier.latency_s": "assumed: 1 ms",
        "tier.capacity_gb": "assumed: 20 TB",
        "session_rate_per_engine": "chosen: engines about half busy (colocated, round_robin)",
    }
    return Profile("gpu-8b", engine, tier, 4.0, (64, 512), sources)


PROFILES = {"cpu-smollm2": cpu_smollm2, "gpu-8b": gpu_8b}


def load_profile(name: str, calibration: Path | None = None) -> Profile:
    """A named profile; with ``calibration`` (a ``bench/fleet_calibrate.py`` JSON line),
    its step costs, KV bytes and G1 capacity replace the profile's.

    Raises:
        KeyError: for an unknown profile name.
    """
    profile = PROFILES[name]()
    if calibration is None:
        return profile
    data = json.loads(calibration.read_text().strip().splitlines()[-1])
    engine = replace(
        profile.engine,
        costs=StepCosts(**{t: float(data["fit"][t]) for t in TERMS}),
        kv_bytes_per_token=int(data["kv_bytes_per_token"]),
        g1_capacity_tokens=int(data["g1_capacity_tokens"]),
    )
    sources = dict(profile.sources)
    sources["engine"] = f"measured: {calibration}"
    return replace(profile, name=f"{name}+calibration", engine=engine, sources=sources)
