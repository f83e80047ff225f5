"""The recommended replica count: measured prefill capacity against demand and a TTFT target.

A pure function of the signals (``router/signals.py``), so the router's
``/scaling`` and ``kvtier_router_recommended_replicas`` and the fleet
simulation's autoscaler (``bench/fleet/scaling.py``) are the same code::

    needed    = demand + in_flight / ttft_target          uncached prompt tokens/s to compute:
                                                          what arrives, and the queue drained
                                                          within the target
    by_cap    = ceil(needed / (capacity x target_utilization))
    by_ttft   = ceil(current x min(ttft_p99 / ttft_target, max_step_up))   only while
                                                          p99 > target (HPA's proportional rule)
    replicas  = clamp(max(by_cap, by_ttft), min_replicas, max_replicas)

``demand`` is the fleet's uncached prompt tokens routed per second and
``capacity`` one engine's measured prefill throughput (tokens per busy
second), both over the signals' window; ``current`` is the engines serving
now. Without a capacity measurement (no request answered yet) ``by_cap`` is
unknown and the count holds at ``current`` unless TTFT says otherwise.
Scale-down damping (stabilisation) is the autoscaler's job (HPA's
``behavior.scaleDown.stabilizationWindowSeconds``, KEDA's ``cooldownPeriod``).
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
            for (headroom for bursts within the window).
        max_step_up: Largest factor the TTFT rule grows the fleet by at once.

    Raises:
        ValueError: for a value that cannot work (names it).
    """

    ttft_target_s: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 64
    target_utilization: float = 0.7
    max_step_up: float = 2.0

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
        if not self.max_step_up >= 1:
            raise ValueError(f"max_step_up must be >= 1, got {self.max_step_up}")


@dataclass(frozen=True)
class Recommendation:
    """How many engines the fleet should run, and why.

    Attributes:
        replicas: The recommendation (within the target's bounds).
        current: Engines serving when it was made.
        by_capacity: What capacity against demand asks for (None: capacity unknown).
        by_ttft: What the TTFT rule asks for (None: p99 within the target, or unknown).
        reason: ``capacity``, ``ttft``, ``hold`` (nothing measured), ``min`` or ``max``
            (a bound decided).
    """

    replicas: int
    current: int
    by_capacity: int | None
    by_ttft: int | None
    reason: str


def replicas_for_capacity(signals: FleetSignals, target: ScalingTarget) -> int | None:
    """``ceil(needed / (capacity x target_utilization))``; None without a capacity measurement."""
    cap = signals.capacity_tokens_per_s
    if cap is None or cap <= 0:
        return None
    needed = signals.demand_tokens_per_s + signals.prefill_tokens_in_flight / target.ttft_target_s
    return math.ceil(needed / (cap * target.target_utilization) - 1e-9)


def replicas_for_ttft(signals: FleetSignals, current: int, target: ScalingTarget) -> int | None:
    """``ceil(current x min(p99 / target, max_step_up))`` while p99 exceeds the target, else None."""
    p99 = signals.ttft_p99_s
    if p99 is None or p99 <= target.ttft_target_s or current < 1:
        return None
    return math.ceil(current * min(p99 / target.ttft_target_s, target.max_step_up))


def recommend_replicas(
    signals: FleetSignals, current: int, target: ScalingTarget
) -> Recommendation:
    """The replica count for ``signals`` when ``current`` engines serve (formula above).

    Raises:
        ValueError: for a negative ``current``.
    """
    if current < 0:
        raise ValueError(f"current must be >= 0, got {current}")
    by_cap = replicas_for_capacity(signals, target)
    by_ttft = replicas_for_ttft(signals, current, target)
    if by_cap is None and by_ttft is None:
        raw, reason = current, "hold"
    elif by_ttft is not None and (by_cap is None or by_ttft > by_cap):
        raw, reason = by_ttft, "ttft"
    else:
        assert by_cap is not None
        raw, reason = by_cap, "capacity"
    if raw < target.min_replicas:
        raw, reason = target.min_replicas, "min"
    elif raw > target.max_replicas:
        raw, reason = target.max_replicas, "max"
    return Recommendation(raw, current, by_cap, by_ttft, reason)
