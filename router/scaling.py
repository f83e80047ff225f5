"""The recommended replica count: measured prefill capacity against demand and a TTFT target.

A pure function of the signals (``router/signals.py``), so the router's
``/scaling`` and ``kvtier_router_recommended_replicas`` and the fleet
simulation's autoscaler (``bench/fleet/scaling.py``) are the same code::

    needed    = demand + in_flight / ttft_target          uncached prompt tokens/s to compute:
                                                          what arrives, and the queue drained
                                                          within the target
    by_cap    = ceil(needed / (capacity x target_utilization))
    by_kv     = ceil(current x kv_usage / kv_target)      the engines' KV memory (G1) in use
    by_ttft   = ceil(current x min(ttft_p99 / ttft_target, max_step_up))   only while
                                                          p99 > target and more requests
                                                          await their first byte than engines serve
    replicas  = clamp(max(by_cap, by_kv, by_ttft), min_replicas, max_replicas)

``demand`` is the fleet's uncached prompt tokens routed per second,
``in_flight`` the uncached prompt tokens routed and not yet answered and
``capacity`` one engine's measured prefill throughput (tokens per busy
second), over the signals' window. By Little's law a steady fleet holds
``demand x mean TTFT`` tokens in flight, so the queue term adds
``demand x mean TTFT / ttft_target``: little while answers come well within
the target, as much as the demand itself when the mean reaches it — and at
once when a burst queues, before the windowed demand has risen. ``current`` is the engines serving
now; ``kv_usage`` their mean KV usage (``vllm:kv_cache_usage_perc``, the
bundled engine's blocks used / total). Prefill capacity alone misses one
limit: an engine whose KV memory is full admits nothing, however fast it
prefills — ``by_kv`` covers it (HPA's proportional rule on memory). The
TTFT rule corrects the model when the measurements lag (a capacity measured
at low load overstates it under load, when decodes share the steps); it
needs requests queued now (more awaiting their first byte than engines
serve), so a window that still holds an old backlog's slow answers does not
keep multiplying the fleet while new replicas start.
Without a measurement (no request answered yet, no KV usage) the count holds
at ``current``.
Scale-down damping (stabilisation) is the autoscaler's job (HPA's
``behavior.scaleDown.stabilizationWindowSeconds``; KEDA passes it on through
``advanced.horizontalPodAutoscalerConfig``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.router.signals import FleetSignals


@dataclass(frozen=True)
class ScalingTarget:
    """What the recommendation aims for.

    Attributes:
        ttft_target_s: The TTFT p99 to hold.
        min_replicas: Fewest engines recommended.
        max_replicas: Most engines recommended.
        target_utilization: Share of an engine's measured prefill capacity to plan
            for. Low because capacity is measured under the load of the moment:
            at light load a prefill has the steps to itself, under load decodes
            share them (the fleet simulation measures up to 2,400 tokens/s per
            engine at light load, 800 on an engine a spike overloads), and the
            rest is headroom for arrivals within the window (docs/fleet.md, the
            scaling comparison's sweep).
        kv_target: The mean KV memory usage (0-1) to hold.
        max_step_up: Largest factor the TTFT rule grows the fleet by at once.

    Raises:
        ValueError: for a value that cannot work (names it).
    """

    ttft_target_s: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 64
    target_utilization: float = 0.4
    kv_target: float = 0.8
    max_step_up: float = 1.5

    def __post_init__(self) -> None:
        if not self.ttft_target_s > 0:
            raise ValueError(f"ttft_target_s must be positive, got {self.ttft_target_s}")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                f"{self.min_replicas} and {self.max_replicas}"
            )
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 < self.kv_target <= 1:
            raise ValueError(f"kv_target must be in (0, 1], got {self.kv_target}")
        if not self.max_step_up >= 1:
            raise ValueError(f"max_step_up must be >= 1, got {self.max_step_up}")


@dataclass(frozen=True)
class Recommendation:
    """How many engines the fleet should run, and why.

    Attributes:
        replicas: The recommendation (within the target's bounds).
        current: Engines serving when it was made.
        by_capacity: What capacity against demand asks for (None: capacity unknown).
        by_kv: What KV memory usage asks for (None: unknown).
        by_ttft: What the TTFT rule asks for (None: p99 within the target, no queue,
            or unknown).
        reason: ``capacity``, ``kv``, ``ttft``, ``hold`` (nothing measured), ``min`` or
            ``max`` (a bound decided).
    """

    replicas: int
    current: int
    by_capacity: int | None
    by_kv: int | None
    by_ttft: int | None
    reason: str


def replicas_for_capacity(signals: FleetSignals, target: ScalingTarget) -> int | None:
    """``ceil(needed / (capacity x target_utilization))``; None without a capacity measurement."""
    cap = signals.capacity_tokens_per_s
    if cap is None or cap <= 0:
        return None
    needed = signals.demand_tokens_per_s + signals.prefill_tokens_in_flight / target.ttft_target_s
    return math.ceil(needed / (cap * target.target_utilization) - 1e-9)


def replicas_for_kv(kv_usage: float | None, current: int, target: ScalingTarget) -> int | None:
    """``ceil(current x kv_usage / kv_target)``; None without a usage figure or engines."""
    if kv_usage is None or current < 1:
        return None
    return math.ceil(current * max(0.0, kv_usage) / target.kv_target - 1e-9)


def replicas_for_ttft(signals: FleetSignals, current: int, target: ScalingTarget) -> int | None:
    """``ceil(current x min(p99 / target, max_step_up))`` while p99 exceeds the target and
    more requests await their first byte than ``current`` engines serve, else None."""
    p99 = signals.ttft_p99_s
    if p99 is None or p99 <= target.ttft_target_s or current < 1:
        return None
    if signals.queue_depth <= current:
        return None  # no queue now: the window's slow answers are history
    return math.ceil(current * min(p99 / target.ttft_target_s, target.max_step_up))


def recommend_replicas(
    signals: FleetSignals,
    current: int,
    target: ScalingTarget,
    kv_usage: float | None = None,
) -> Recommendation:
    """The replica count for ``signals`` when ``current`` engines serve (formula above).

    Args:
        signals: The fleet's signals.
        current: Engines serving now (healthy, prefilling).
        target: What to aim for.
        kv_usage: Their mean KV memory usage, 0-1 (None: unknown).

    Raises:
        ValueError: for a negative ``current``.
    """
    if current < 0:
        raise ValueError(f"current must be >= 0, got {current}")
    by_cap = replicas_for_capacity(signals, target)
    by_kv = replicas_for_kv(kv_usage, current, target)
    by_ttft = replicas_for_ttft(signals, current, target)
    # the largest ask decides (ties: the first named)
    asks = [(n, why) for n, why in ((by_cap, "capacity"), (by_kv, "kv"), (by_ttft, "ttft"))
            if n is not None]  # fmt: skip
    if not asks:
        raw, reason = current, "hold"
    else:
        raw, reason = max(asks, key=lambda a: a[0])
    if raw < target.min_replicas:
        raw, reason = target.min_replicas, "min"
    elif raw > target.max_replicas:
        raw, reason = target.max_replicas, "max"
    return Recommendation(raw, current, by_cap, by_kv, by_ttft, reason)
