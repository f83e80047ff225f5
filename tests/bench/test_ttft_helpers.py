"""What makes ``bench/ttft.py`` honest: its lengths, its CPU hog and its page-cache drop."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvtier.bench.lib.common import busy_core, drop_page_cache
from kvtier.bench.ttft import RANDOM_MAX, RANDOM_MIN, Sample, make_cases, random_lengths, summarize


def test_random_lengths_are_in_range_and_never_block_aligned() -> None:
    lengths = random_lengths(200, seed=1)
    assert all(RANDOM_MIN <= n <= RANDOM_MAX and n % 16 for n in lengths)
    assert len(set(lengths)) > 100  # drawn, not a few fixed sizes
    assert random_lengths(5, seed=1) == lengths[:5]  # reproducible


def test_every_case_has_its_own_prompt_and_warm_up() -> None:
    cases = make_cases({"1024": [1024, 1024], "random": [1500]}, first_salt=10)
    salts = [c.salt for c in cases] + [c.warm_salt for c in cases]
    assert len(set(salts)) == len(salts)
    assert [c.n for c in cases] == [1024, 1024, 1500]


def test_summary_is_the_median_of_k() -> None:
    s = summarize([Sample(t, c, 0) for t, c in ((3.0, 1), (1.0, 9), (100.0, 2))])
    assert s["p50_s"] == 3.0 and s["k"] == 3 and s["computed_max"] == 9
    assert (s["min_s"], s["max_s"]) == (1.0, 100.0)


def test_the_cpu_hog_spins_and_is_gone_after_the_block() -> None:
    with busy_core(60) as pid:
        stat = Path(f"/proc/{pid}/stat")
        deadline = time.monotonic() + 30
        ticks = 0
        while ticks == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            fields = stat.read_text().rsplit(")", 1)[1].split()
            ticks = int(fields[11]) + int(fields[12])  # utime + stime
        assert ticks > 0  # it is burning CPU
    assert not os.path.exists(f"/proc/{pid}")


def test_page_cache_drop_reaches_every_block_file(tmp_path: Path) -> None:
    for i in range(3):
        sub = tmp_path / "blocks" / f"{i:02x}"
        sub.mkdir(parents=True)
        (sub / f"{i}.blk").write_bytes(os.urandom(1 << 16))
    assert drop_page_cache(tmp_path) == 3
    assert drop_page_cache(tmp_path / "missing") == 0
