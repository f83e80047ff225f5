"""``bench/serve_router.py``: its bars, budgets, workloads, warm-start rate and JSON line (no engine started)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import serve_router
from kvtier.bench.lib.router_capacity import Capacity, send_closed_loop, sized_rate
from kvtier.bench.lib.router_fleet import FleetOptions, cpu_slot, kvtier_server, vllm_server
from kvtier.bench.lib.router_warm import WarmLoad, _prime_order
from tests.bench.fake_openai import FakeOpenAI


def _run(hit: float | None, ttft_p99: float, itl_p99: float) -> dict[str, float | None]:
    return {"hit_rate": hit, "ttft_p99_s": ttft_p99, "itl_p99_s": itl_p99}


def _failover(interrupted: int, completed: int, failed: int) -> dict[str, Any]:
    return {
        "streams_interrupted": interrupted,
        "streams_completed": completed,
        "failed_requests": failed,
        "tokens_loaded_from_tier": 900,
        "tokens_recomputed": 40,
    }


def test_the_bars_compare_each_phase_with_its_baseline() -> None:
    results: dict[str, Any] = {
        "policies": {"round_robin": _run(0.40, 2.0, 0.1), "cache_aware": _run(0.60, 1.5, 0.1)},
        "failover": _failover(2, 2, 0),
        "warm_start": {"with": _run(None, 1.0, 0.1), "without": _run(None, 2.5, 0.1)},
        "pd": {"colocated": _run(None, 3.0, 1.2), "pd": _run(None, 3.5, 0.2)},
    }
    assert serve_router.bars(results) == {
        "cache_aware_hit_rate_ge_round_robin_plus_0.15": True,
        "cache_aware_ttft_p99_le_round_robin": True,
        "failover_no_failed_requests": True,
        "failover_streams_completed_eq_interrupted": True,
        "warm_ttft_p99_le_half_cold": True,
        "pd_itl_p99_lt_colocated": True,
    }
    results["policies"]["cache_aware"] = _run(0.50, 2.5, 0.1)
    results["failover"] = _failover(2, 1, 1)
    results["warm_start"]["with"] = _run(None, 1.3, 0.1)
    results["pd"]["pd"] = _run(None, 3.5, 1.3)
    assert set(serve_router.bars(results).values()) == {False}
    # a missing figure, and a failover that interrupted nothing, prove nothing
    results = {"policies": {"round_robin": _run(None, 2.0, 0.1), "cache_aware": _run(0.6, 1, 0)}}
    results["failover"] = _failover(0, 0, 0)
    out = serve_router.bars(results)
    assert out["cache_aware_hit_rate_ge_round_robin_plus_0.15"] is None
    assert out["failover_streams_completed_eq_interrupted"] is None
    assert out["failover_no_failed_requests"] is True


def test_budgets_are_tokens_converted_at_each_engines_dtype(tmp_path: Path) -> None:
    def memory(dtype: str) -> int:
        server = kvtier_server(FleetOptions("kvtier", dtype), tmp_path, "e", 3600)
        assert server.cmd[server.cmd.index("--dtype") + 1] == dtype
        return int(server.cmd[server.cmd.index("--kv-cache-memory") + 1])

    assert memory("bfloat16") == 3600 * 23_040  # SmolLM2: 30 x 2 x 3 x 64 x 2 bytes
    assert memory("float32") == 2 * memory("bfloat16")  # the same tokens, not the same bytes
    vllm = FleetOptions("vllm", "float32")
    assert vllm.g1_tokens(3600) == 3584  # whole 128-token blocks
    server, events = vllm_server(vllm, tmp_path, "v", 3600, model_dir=tmp_path)
    cmd = server.command(Path("python"))
    assert cmd[cmd.index("--num-gpu-blocks-override") + 1] == "28"
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert events["endpoint"].startswith("ipc://")  # vLLM binds it; nothing listens on TCP
    with pytest.raises(ValueError):
        FleetOptions("kvtier", "float32").g1_tokens(16)


def test_vllm_engines_up_together_bind_their_own_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {4, 5, 6})
    with cpu_slot(1) as first, cpu_slot(1) as second:
        assert (first, second) == ([4], [5])  # not both on CPU 4
        with cpu_slot(1) as third, cpu_slot(1) as fourth:
            assert (third, fourth) == ([6], [4])  # wraps round a host with fewer CPUs
        server, _ = vllm_server(
            FleetOptions("vllm", "float32"), tmp_path, "v", 3600, model_dir=tmp_path, cpus=second
        )
        env = server.environment(tmp_path / "libiomp5.so")
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "5"
    with cpu_slot(1) as again:
        assert again == [4]  # the slots of stopped engines are free again
    with cpu_slot(None) as every:
        assert every is None  # threads not set: vLLM binds all of them


def test_long_prompts_are_unique_documents_of_the_asked_length() -> None:
    args = serve_router.parse_args(["--quick", "--pd-prompt-tokens", "200", "--pd-requests", "4"])
    assert args.users % 2 == 1  # round robin must not keep a user on one engine by accident
    count = lambda text: len(text.split())  # noqa: E731 - one token per word
    w = serve_router.long_prompts(args, count, seed=3)
    assert w.planned == 4 and w.max_tokens == args.pd_answer_tokens
    texts = [lane.session.messages()[0]["content"] for lane in w.lanes]
    assert len(set(texts)) == 4
    arrivals = [lane.arrivals[0] for lane in w.lanes]
    assert arrivals == sorted(arrivals)


def test_phases_default_by_engine_and_refuse_pd_with_vllm() -> None:
    assert serve_router.parse_args([]).phase_list == list(serve_router.PHASES)
    assert "pd" not in serve_router.parse_args(["--engine", "vllm"]).phase_list
    with pytest.raises(SystemExit):
        serve_router.parse_args(["--engine", "vllm", "--phases", "pd"])
    with pytest.raises(SystemExit):
        serve_router.parse_args(["--phases", "policies,bogus"])


def test_the_last_line_is_json_with_every_phase_and_the_bars(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    canned = {
        "policies": {"round_robin": _run(0.3, 2.0, 0.1), "cache_aware": _run(0.7, 1.0, 0.1)},
        "failover": _failover(3, 3, 0),
        "warm_start": {"with": _run(None, 0.4, 0.1), "without": _run(None, 1.0, 0.1)},
    }
    for phase, value in canned.items():
        monkeypatch.setitem(serve_router.RUNNERS, phase, lambda *a, _v=value: _v)
    monkeypatch.setattr("kvtier.bench.lib.serve_workloads.token_counter", lambda name: len)
    monkeypatch.setattr(serve_router, "machine", lambda: {})
    monkeypatch.setattr(serve_router.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    serve_router.main(["--quick", "--engine", "vllm", "--dtype", "float32"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["engine"] == "vllm" and last["dtype"] == "float32"
    assert last["g1_tokens_per_engine"] == 3584
    for policy in ("round_robin", "cache_aware"):
        assert {"hit_rate", "ttft_p99_s"} <= last["policies"][policy].keys()
    assert set(serve_router.bars(canned)) == set(last["bars"])
    assert all(last["bars"].values())
    assert last["failover"]["streams_completed"] == 3
    assert {"with", "without"} == set(last["warm_start"])


def test_the_warm_start_rate_is_a_share_of_the_measured_capacity() -> None:
    """The warm-start window's rate is ``load`` x what the engine completes in a closed loop
    (bench/lib/router_capacity.py): more in flight on an engine that serves them in parallel
    completes more per second; a measurement where requests failed gives no rate."""
    msgs = [[{"role": "user", "content": f"question {i}"}] for i in range(8)]
    with FakeOpenAI(tokens=5, delay_s=0.02) as fake:  # 0.1 s a request, served in parallel

        def measure(concurrency: int, batch: list[list[dict[str, str]]] = msgs) -> Capacity:
            streams, elapsed_s = asyncio.run(
                send_closed_loop(fake.url, batch, concurrency=concurrency, max_tokens=5,
                                 timeout_s=30.0)
            )  # fmt: skip
            return Capacity.of(streams, elapsed_s, concurrency)

        one, four = measure(1), measure(4)
        failing = measure(2, [[{"role": "user", "content": "behaviour=http500"}]] * 4)
    assert len(one.e2e_s) == len(four.e2e_s) == 8 and one.errors == four.errors == 0
    assert one.requests_per_s <= 1 / 0.1 + 1e-9  # one at a time: at most one per 0.1 s
    assert four.requests_per_s > 2 * one.requests_per_s
    assert sized_rate(four, 0.5) == pytest.approx(0.5 * four.requests_per_s)
    assert four.to_json()["completed"] == 8
    assert failing.first_error is not None and "500" in failing.first_error
    with pytest.raises(ValueError, match=r"failed.*500"):
        sized_rate(failing, 0.5)
    with pytest.raises(ValueError, match="load"):
        sized_rate(four, 1.5)


def test_warm_start_options_are_checked_before_anything_starts() -> None:
    args = serve_router.parse_args(["--quick", "--phases", "warm_start"])
    assert args.warm_qps is None and args.warm_load == 0.5  # measured, then halved
    with pytest.raises(SystemExit):
        serve_router.parse_args(["--warm-load", "0"])
    with pytest.raises(SystemExit):
        serve_router.parse_args(["--warm-qps", "-1"])
    with pytest.raises(ValueError, match="load"):
        WarmLoad(load=1.5)
    with pytest.raises(ValueError, match="positive"):
        WarmLoad(qps=0.0)
    with pytest.raises(ValueError, match="concurrency"):
        WarmLoad(prime_concurrency=0)


def test_priming_asks_every_document_once_before_any_twice() -> None:
    load = WarmLoad(documents=5, prime_rounds=3)
    for seed in range(20):
        order = _prime_order(load, random.Random(seed))
        assert sorted(order) == sorted(list(range(5)) * 3)
        for r in range(3):  # rounds of all documents
            assert sorted(order[5 * r : 5 * r + 5]) == list(range(5))
        assert all(a != b for a, b in itertools.pairwise(order))
