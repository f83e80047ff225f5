"""The latency tier: a fixed wait before the inner tier answers, cut short by deadlines."""

from __future__ import annotations

import pytest

from kvtier.config import KvtierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.factory import build_tier
from kvtier.tiers import latency
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.latency import LatencyTier

KEY = b"k" * 16


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(latency.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(latency.time, "sleep", fake.sleep)
    return fake


def _tier(**kw: float) -> LatencyTier:
    inner = CpuTier(1 << 20)
    inner.put([(KEY, b"block")])
    return LatencyTier(inner, **kw)


def test_every_get_waits_then_answers(clock: FakeClock) -> None:
    tier = _tier(get_s=0.05)
    assert tier.get([KEY, b"x" * 16]) == [b"block", None]
    assert tier.contains([KEY]) == [True]  # lookups not delayed unless asked
    assert clock.slept == [0.05]


def test_a_deadline_cuts_the_wait_short_and_returns_misses(clock: FakeClock) -> None:
    tier = _tier(get_s=3.0, contains_s=3.0)
    assert tier.get([KEY], deadline=clock.now + 0.5) == [None]
    assert tier.contains([KEY], deadline=clock.now + 0.25) == [False]
    assert clock.slept == [0.5, 0.25]
    assert tier.get([KEY], deadline=clock.now + 5.0) == [b"block"]


def test_configured_in_yaml_around_any_tier() -> None:
    config = load_config(
        env={},
        overrides={
            "tiers": [
                {"type": "latency", "get_ms": 50, "tier": {"type": "cpu", "capacity": "1MiB"}}
            ]
        },
    )
    (section,) = config.tiers
    assert section.name == "cpu"
    tier = build_tier(section)
    assert isinstance(tier, LatencyTier)
    assert tier.get_s == pytest.approx(0.05)
    assert isinstance(tier.inner, CpuTier)


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "latency", "get_ms": -1, "tier": {"type": "cpu"}},
        {"type": "latency", "get_ms": 5},
        {"type": "latency", "tier": {"type": "latency", "tier": {"type": "cpu"}}},
    ],
)
def test_bad_sections_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        load_config(env={}, overrides={"tiers": [bad]})


def test_the_whole_config_round_trips() -> None:
    data = {"tiers": [{"type": "latency", "get_ms": 50, "tier": {"type": "cpu"}}]}
    config = load_config(env={}, overrides=data)
    again = KvtierConfig.model_validate(config.model_dump(mode="json"))
    assert again == config
