"""The engine's thread policy: a fixed count, or ``auto`` following what other processes use."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvtier.cli import main
from kvtier.engine import LLM
from kvtier.engine.config import EngineConfig
from kvtier.engine.errors import EngineConfigError
from kvtier.engine.threads import (
    CpuSample,
    ThreadPolicy,
    others_busy_cores,
    read_cpu_sample,
    threads_for,
)
from tests.engine.tiny_models import write_tiny_model


class FakeHost:
    """A host of ``len(cores)`` cores whose neighbours use ``others`` cores; we use ``own`` cores."""

    def __init__(self, cores: int) -> None:
        self.cores = list(range(cores))
        self.others = 0.0
        self.own = 0.0
        self.t = 0.0
        self.busy_s = 0.0
        self.own_s = 0.0
        self.applied: list[int] = []

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.busy_s += (self.others + self.own) * seconds
        self.own_s += self.own * seconds

    def sample(self, cores: list[int]) -> CpuSample:
        assert cores == self.cores
        return CpuSample(self.t, self.busy_s, self.own_s)

    def policy(self, setting: int | str | None, interval_s: float = 1.0) -> ThreadPolicy:
        return ThreadPolicy(
            setting,  # type: ignore[arg-type]
            cores=self.cores,
            interval_s=interval_s,
            sample=self.sample,
            set_threads=self.applied.append,
        )


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeHost:
    host = FakeHost(cores=4)
    monkeypatch.setattr(time, "monotonic", lambda: host.t)
    return host


def test_threads_leave_the_cores_others_use() -> None:
    assert threads_for(2, 0.0) == 2
    assert threads_for(2, 0.3) == 2  # background noise keeps every core
    assert threads_for(2, 0.6) == 1  # a neighbour squeezed by our team still counts
    assert threads_for(2, 1.0) == 1
    assert threads_for(2, 5.0) == 1  # never fewer than one
    assert threads_for(8, 2.4) == 6
    # a team that shrank grows back only once the others clearly leave a core idle
    assert threads_for(2, 0.4, current=1) == 1
    assert threads_for(2, 0.25, current=1) == 2
    assert threads_for(2, 0.4, current=2) == 2
    assert threads_for(8, 1.4, current=5) == 6  # by as many cores as are free, less the margin


def test_others_are_the_busy_time_that_is_not_ours() -> None:
    a = CpuSample(wall=10.0, busy=100.0, own=5.0)
    b = CpuSample(wall=12.0, busy=103.0, own=6.0)  # 3 busy core-seconds, 1 of them ours
    assert others_busy_cores(a, b) == pytest.approx(1.0)
    assert others_busy_cores(a, a) == 0.0


def test_auto_shrinks_while_a_neighbour_is_busy_and_grows_back(clock: FakeHost) -> None:
    p = clock.policy("auto")
    assert p.start() == 4 and clock.applied == [4]
    clock.own = 4.0
    clock.advance(0.5)
    assert p.tick() is None  # the window is not over yet
    clock.others = 1.0
    clock.own = 3.0  # our 4 threads on 4 cores squeezed by one busy neighbour
    clock.advance(1.0)
    assert p.tick() == 3 and clock.applied[-1] == 3
    clock.advance(1.0)
    assert p.tick() is None  # stable: the neighbour keeps its core
    clock.others, clock.own = 0.0, 3.0
    clock.advance(1.0)
    assert p.tick() == 4  # the neighbour left
    assert p.changes == 2 and p.threads == 4


def test_a_fixed_count_never_changes(clock: FakeHost) -> None:
    p = clock.policy(2)
    assert p.start() == 2
    clock.others = 4.0
    clock.advance(5.0)
    assert p.tick() is None and clock.applied == [2]


def test_auto_keeps_all_cores_where_proc_stat_cannot_be_read(clock: FakeHost) -> None:
    p = ThreadPolicy("auto", cores=[0, 1], sample=lambda cores: None, set_threads=lambda n: None)
    assert p.start() == 2
    clock.advance(5.0)
    assert p.tick() is None and p.threads == 2


def test_proc_stat_is_read_for_the_usable_cores_only(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  300 0 100 900 10 0 0 0 0 0\n"
        "cpu0 100 0 50 400 5 0 0 0 0 0\n"
        "cpu1 200 0 50 500 5 0 0 7 0 0\n"
        "intr 1 2 3\n"
    )
    s = read_cpu_sample([1], str(stat))
    assert s is not None
    # user + system + steal of cpu1, idle and iowait left out
    assert s.busy * os.sysconf("SC_CLK_TCK") == pytest.approx(257)
    assert read_cpu_sample([0, 5], str(stat)) is None  # a core that is not listed
    assert read_cpu_sample([0], str(tmp_path / "missing")) is None


@pytest.mark.parametrize("bad", [0, -1, "four", 1.5, True])
def test_bad_thread_settings_are_config_errors(bad: object) -> None:
    with pytest.raises(EngineConfigError, match="num_threads"):
        EngineConfig(model="m.gguf", num_threads=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_threads"):
        ThreadPolicy(bad)  # type: ignore[arg-type]


def test_engine_applies_the_policy(tmp_path: Path) -> None:
    path, _ = write_tiny_model(tmp_path, "llama", seed=3)
    before = torch.get_num_threads()
    try:
        one = LLM(str(path), dtype="float32", device="cpu", num_threads=1)
        assert torch.get_num_threads() == 1 and not one.engine.threads.adaptive
        auto = LLM(str(path), dtype="float32", device="cpu", num_threads="auto")
        policy = auto.engine.threads
        assert policy.adaptive and 1 <= policy.threads <= len(policy.cores)
        assert torch.get_num_threads() == policy.threads
        default = LLM(str(path), dtype="float32", device="cpu")
        assert default.engine.threads.adaptive
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("flag", "ok"), [("auto", True), ("1", True), ("0", False), ("x", False)])
def test_the_threads_flag_takes_a_count_or_auto(tmp_path: Path, flag: str, ok: bool) -> None:
    path, _ = write_tiny_model(tmp_path, "llama", seed=3)
    args = ["generate", "-m", str(path), "--dtype", "float32", "--device", "cpu"]
    before = torch.get_num_threads()
    try:
        result = CliRunner().invoke(main, [*args, "--threads", flag, "-n", "2", "hello"])
    finally:
        torch.set_num_threads(before)
    if ok:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 2 and "neither 'auto' nor an integer" in result.output
