"""How many CPU threads torch uses: a fixed count, or one adapted to what other processes use.

Torch's CPU ops run on an OpenMP team whose threads spin-wait for each other
at every parallel region. When another process holds one of the cores the
team runs on, the thread that shares that core is descheduled while its
siblings spin, and a step can take many times longer than with one thread
(measured in docs/engine.md, "dtype and threads on CPU"). A team no larger
than the cores nobody else is using avoids that.

``ThreadPolicy("auto")`` measures, over a window of about a second, how many
cores other processes kept busy: the CPU time ``/proc/stat`` counts for the
cores this process may run on, minus this process's own CPU time (every
thread of it), divided by the window's wall time. It then sets
``cores - round(others)`` threads, at least one, and grows back once the
others leave a core idle with a margin. It samples when the engine
starts (over the model load) and then at most once per interval, from the
step thread, so the count follows a neighbour that comes and goes. Where
``/proc/stat`` cannot be read it keeps all cores.

Reducing the team is stable under its own feedback: once it runs on fewer
cores, the busy neighbour gets its core back and keeps counting as busy; when
it stops, the measured load drops and the team grows again.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from kvtier.engine.config import AUTO_THREADS as AUTO
from kvtier.engine.config import NumThreads

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
GROW_MARGIN = 0.3  # of a core: how far below a whole core the others must stay to give it back
# NOTE: /proc/stat fields after the cpu name: user nice system idle iowait irq
# softirq steal guest guest_nice. idle and iowait are the only ones a core
# could have spent on us; guest time is already inside user.
_IDLE_FIELDS = (3, 4)
_COUNTED_FIELDS = 8


def usable_cores() -> list[int]:
    """The CPU numbers this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class CpuSample:
    """One reading of the clocks the policy compares.

    Attributes:
        wall: ``time.monotonic()`` seconds.
        busy: CPU-seconds the usable cores spent not idle, since boot (every process).
        own: CPU-seconds this process spent, all its threads.
    """

    wall: float
    busy: float
    own: float


def read_cpu_sample(cores: list[int], stat_path: str = "/proc/stat") -> CpuSample | None:
    """Reads ``/proc/stat`` for ``cores``; ``None`` where it cannot be read or parsed."""
    wanted = {f"cpu{c}" for c in cores}
    ticks = 0
    found = 0
    try:
        with open(stat_path, encoding="ascii") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break  # the cpu lines come first
                name, *fields = line.split()
                if name not in wanted:
                    continue
                values = [int(v) for v in fields[:_COUNTED_FIELDS]]
                ticks += sum(values) - sum(values[i] for i in _IDLE_FIELDS)
                found += 1
    except (OSError, ValueError, IndexError):
        return None
    if found != len(wanted):
        return None
    return CpuSample(time.monotonic(), ticks / os.sysconf("SC_CLK_TCK"), time.process_time())


def others_busy_cores(before: CpuSample, after: CpuSample) -> float:
    """Cores kept busy by other processes between two samples (0 when the window is empty)."""
    wall = after.wall - before.wall
    if wall <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others / wall)


def threads_for(cores: int, others: float, current: int | None = None) -> int:
    """The team size that leaves the cores others use to them, at least one.

    A team shrinks to ``cores - round(others)``; it grows back only once the
    others would leave a core idle with a margin (``cores - ceil(others - 0.3)``),
    so a neighbour that hovers around half a core does not flip it every window.
    """
    shrink = cores - math.floor(others + 0.5)
    grow = cores - math.ceil(others - GROW_MARGIN)
    if current is None or shrink < current:
        want = shrink
    elif grow > current:
        want = grow
    else:
        want = current
    return max(1, min(cores, want))


class ThreadPolicy:
    """Sets ``torch.set_num_threads`` once (a count) or keeps adapting it (``"auto"``).

    Not thread-safe: ``start`` and ``tick`` are called from the engine's step thread.

    Args:
        setting: A positive count, ``"auto"``, or ``None`` (``"auto"``).
        cores: The usable CPU numbers (default: this process's affinity).
        interval_s: Shortest window between two ``auto`` samples.
        sample: Reads a ``CpuSample`` for ``cores`` (tests pass a fake).
        set_threads: Applies a count (default ``torch.set_num_threads``).
    """

    def __init__(
        self,
        setting: NumThreads,
        *,
        cores: list[int] | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        sample: Callable[[list[int]], CpuSample | None] = read_cpu_sample,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        bad_count = isinstance(setting, bool) or not isinstance(setting, int) or setting < 1
        if setting is not None and setting != AUTO and bad_count:
            raise ValueError(f"num_threads must be 'auto' or an integer >= 1, got {setting!r}")
        self.setting: int | Literal["auto"] = AUTO if setting is None else setting
        self.cores = cores if cores is not None else usable_cores()
        self.interval_s = interval_s
        self._sample = sample
        self._set_threads = set_threads
        self._last: CpuSample | None = None
        self.threads = 0
        self.changes = 0
        self.others = 0.0  # cores other processes used in the last window

    @property
    def adaptive(self) -> bool:
        return self.setting == AUTO

    def start(self) -> int:
        """Applies the fixed count, or all usable cores for ``auto`` (then starts a window)."""
        if self.adaptive:
            self._apply(len(self.cores))
            self._last = self._sample(self.cores)
        else:
            assert isinstance(self.setting, int)
            self._apply(self.setting)
        return self.threads

    def tick(self, min_window_s: float | None = None) -> int | None:
        """Re-decides the ``auto`` count once a window has passed; the new count when it changed.

        Args:
            min_window_s: The shortest window that counts (default ``interval_s``);
                the engine decides once at the end of its start-up with a shorter one.
        """
        if self._last is None:
            return None
        window = self.interval_s if min_window_s is None else min_window_s
        if time.monotonic() - self._last.wall < window:
            return None
        now = self._sample(self.cores)
        if now is None:
            return None
        self.others = others_busy_cores(self._last, now)
        self._last = now
        want = threads_for(len(self.cores), self.others, self.threads)
        if want == self.threads:
            return None
        logger.info(
            "other processes kept %.2f of %d cores busy: %d -> %d torch threads",
            self.others,
            len(self.cores),
            self.threads,
            want,
        )
        self._apply(want)
        self.changes += 1
        return want

    def _apply(self, n: int) -> None:
        self._set_threads(n)
        self.threads = n
