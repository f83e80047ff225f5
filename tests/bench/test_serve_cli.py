"""bench/serve.py end to end against the fake server, and the systems it knows (nothing started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import serve
from kvtier.bench.lib.serve_systems import (
    SystemOptions,
    SystemSpec,
    SystemUnavailable,
    kv_bytes_per_token,
    running_system,
    tier_config,
    vllm_server_kwargs,
)
from kvtier.config import load_config
from tests.bench.fake_openai import FakeOpenAI

SYSTEM_KEYS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "requests_per_s",
    "hit_rate",
    "requests",
)


def test_budgets_are_tokens_converted_by_each_systems_dtype() -> None:
    bf16 = SystemOptions(dtype="bfloat16", small_kv_tokens=56 * 128)
    fp32 = SystemOptions(dtype="float32", small_kv_tokens=56 * 128)
    assert kv_bytes_per_token("bfloat16") == 23_040
    assert kv_bytes_per_token("float32") == 46_080
    assert bf16.kv_tokens(small=True) == fp32.kv_tokens(small=True) == 56 * 128
    assert bf16.kv_bytes(small=True) == 56 * 128 * 23_040
    assert fp32.kv_bytes(small=True) == 2 * bf16.kv_bytes(small=True)
    # kvtier's engine divides the bytes into 16-token blocks: exactly 56 * 8 of them
    assert fp32.kv_bytes(small=True) % (16 * 46_080) == 0
    assert bf16.kv_bytes(small=False) <= 1 << 30 < fp32.kv_bytes(small=False)


def test_vllm_gets_the_same_tokens_as_blocks_in_enough_memory(tmp_path: Path) -> None:
    for dtype, gib in (("bfloat16", 1), ("float32", 2)):
        opts = SystemOptions(dtype=dtype)
        kw = vllm_server_kwargs(SystemSpec.named("vllm"), opts, tmp_path / "log")
        assert kw["num_gpu_blocks"] * 128 == opts.big_kv_tokens
        assert kw["kv_cache_gib"] == gib
        assert kw["num_gpu_blocks"] * 128 * kv_bytes_per_token(dtype) <= gib << 30
        assert kw["extra_args"][kw["extra_args"].index("--dtype") + 1] == dtype


def test_bad_budgets_are_refused() -> None:
    SystemOptions(small_kv_tokens=25 * 128, max_model_len=3072)  # 24 usable blocks: exactly 3072
    with pytest.raises(ValueError, match="usable tokens"):
        SystemOptions(small_kv_tokens=24 * 128, max_model_len=3072)
    with pytest.raises(ValueError, match="multiple of 128"):
        SystemOptions(big_kv_tokens=1000)
    with pytest.raises(ValueError, match="dtype"):
        SystemOptions(dtype="float16")


def test_system_names() -> None:
    spec = SystemSpec.named("kvtier_small_g1_cpu_tier")
    assert (spec.engine, spec.small, spec.tier) == ("kvtier", True, "cpu")
    assert SystemSpec.named("vllm_small_kv").engine == "vllm"
    with pytest.raises(ValueError, match="unknown system"):
        SystemSpec.named("sglang")


@pytest.mark.parametrize("tier", ["cpu", "disk", "server"])
def test_tier_configs_validate(tmp_path: Path, tier: str) -> None:
    path = tier_config(tier, SystemOptions(), tmp_path, "127.0.0.1:50051")  # type: ignore[arg-type]
    config = load_config(path, env={})
    assert [t.type for t in config.tiers] == [{"server": "remote"}.get(tier, tier)]


def test_missing_vllm_is_a_skip(tmp_path: Path) -> None:
    opts = SystemOptions(vllm_venv=tmp_path / "no-such-venv")
    with pytest.raises(SystemUnavailable), running_system(SystemSpec.named("vllm"), opts, tmp_path):
        pass


@pytest.mark.smollm2
def test_target_run_prints_the_json_line_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeOpenAI(tokens=4) as fake:
        serve.main(
            [
                "--target", fake.url, "--users", "2", "--rounds", "2", "--qps", "50",
                "--system-tokens", "40", "--context-tokens", "30", "--answer-tokens", "4",
                "--plots-dir", str(tmp_path), "--records", str(tmp_path / "records.jsonl"),
            ]
        )  # fmt: skip
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    target = summary["systems"]["target"]
    assert all(k in target for k in SYSTEM_KEYS)
    assert target["requests"] == 4 and target["errors"] == 0
    assert target["model"] == "fake"  # from /v1/models
    assert target["hit_rate_source"] == "metrics"
    assert target["hit_rate"] == pytest.approx(target["hit_rate_usage"], abs=0.01)
    assert summary["workload"]["users"] == 2
    assert (tmp_path / "serve-ttft-cdf.png").stat().st_size > 0
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 4


@pytest.mark.smollm2
def test_sweep_plots_ttft_against_qps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeOpenAI(tokens=3) as fake:
        serve.main(
            [
                "--target", fake.url, "--users", "2", "--rounds", "1", "--sweep-qps", "20,40",
                "--system-tokens", "20", "--context-tokens", "20", "--answer-tokens", "3",
                "--plots-dir", str(tmp_path),
            ]
        )  # fmt: skip
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["qps"] for p in summary["sweep"]["target"]] == [20.0, 40.0]
    assert (tmp_path / "serve-ttft-vs-qps.png").stat().st_size > 0


def test_small_kv_systems_get_their_own_sustained_rate() -> None:
    args = serve.parse_args(
        ["--systems", "kvtier,kvtier_small_g1,vllm_small_kv", "--sustained", "--dtype", "float32"]
    )
    plan = serve.make_plan(args)
    assert plan.small == {"kvtier_small_g1", "vllm_small_kv"}


@pytest.mark.smollm2
def test_sustained_run_reports_each_systems_user_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeOpenAI(tokens=2) as fake:
        serve.main(
            [
                "--target", fake.url, "--users", "1", "--rounds", "1", "--qps", "50",
                "--system-tokens", "20", "--context-tokens", "20", "--answer-tokens", "2",
                "--sustained", "--user-rate", "3", "--small-user-rate", "1", "--sustained-s", "2",
                "--think-s", "0", "--plots-dir", str(tmp_path),
            ]
        )  # fmt: skip
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    sustained = summary["sustained"]
    assert sustained["user_rate"] == 3.0 and sustained["small_user_rate"] == 1.0
    assert sustained["systems"]["target"]["user_rate"] == 3.0  # a target is not a small system
    assert "users/s" in out
    assert (tmp_path / "serve-sustained-ttft-cdf.png").stat().st_size > 0


@pytest.mark.smollm2
def test_calibration_measures_both_decode_batches() -> None:
    from kvtier.bench.lib.serve_calibrate import calibrate

    cal = calibrate("float32", tokens=300, samples=1, decode_batch=2, decode_steps=2)
    out = cal.to_dict()
    assert out["decode_batch"] == 2 and out["small_decode_batch"] == 1
    assert out["decode_tokens_per_s"] > 0 and out["small_decode_tokens_per_s"] > 0
    assert cal.prefill_tokens_per_s > 0
    with pytest.raises(ValueError):
        calibrate("float32", small_decode_batch=0)


def test_router_runs_pass_the_phases_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--router --phases`` reaches bench/serve_router.py (it ran every phase before), and the
    phases it gets are the ones it parses; ``--phases`` without ``--router`` is an error."""
    import kvtier.bench.serve_router as serve_router

    seen: list[list[str]] = []
    monkeypatch.setattr(serve_router, "main", lambda argv=None: seen.append(list(argv or [])))
    serve.main(["--quick", "--router", "--engine", "vllm", "--phases", "warm_start"])
    serve.main(["--router"])
    with_phases, without = seen
    assert with_phases[with_phases.index("--phases") + 1] == "warm_start"
    assert with_phases[with_phases.index("--engine") + 1] == "vllm"
    assert serve_router.parse_args(with_phases).phase_list == ["warm_start"]
    assert "--phases" not in without  # the router bench's own default: every phase
    with pytest.raises(SystemExit):
        serve.parse_args(["--phases", "warm_start"])
