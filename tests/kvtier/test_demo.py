from __future__ import annotations

from kvtier.demo import run_store_demo


def test_demo_reports_hits_and_survives_restart() -> None:
    lines: list[str] = []
    reports = run_store_demo(config_path=None, num_requests=6, seed=1, echo=lines.append)
    first, restart = reports
    assert first.requests == 6 and first.chunks_requested > 0
    assert first.bytes_saved > 0
    assert restart.chunks_hit == restart.chunks_requested  # everything came back from disk/CPU
    assert restart.tier_hits["disk"] > 0  # the CPU tier was empty after the restart
    assert first.wrong_blocks == restart.wrong_blocks == 0
    text = "\n".join(lines)
    assert "every loaded block matched" in text and "hit rate" in text
