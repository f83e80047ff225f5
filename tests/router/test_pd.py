"""P/D disaggregation with two real ``kvtier engine serve`` processes and a ``kvtier serve``
cache server between them: the decode engine loads the prompt's KV the prefill engine
saved, and its greedy answer equals a single engine's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvtier.engine import LLM, SamplingParams
from kvtier.engine.models.loader import load_tokenizer
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig
from kvtier.router.prompt import prompt_token_ids
from tests.server.helpers import running_server

pytestmark = pytest.mark.slow
CHUNK = 32


@contextmanager
def engine_process(model: Path, config: Path, role: str, log: Path) -> Iterator[str]:
    cmd = [
        sys.executable, "-m", "kvtier.cli", "engine", "serve", "-m", str(model), "--port", "0",
        "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
        "--kv-cache-memory", "8MiB", "--threads", "1", "--role", role,
        "--kv-connector", "kvtier", "--kvtier-config", str(config),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None:
            assert proc.poll() is None, f"engine exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"engine did not start: {log.read_text()}"
            for line in log.read_text().splitlines():
                if " on http://" in line:
                    url = line.split(" on ", 1)[1].split()[0]
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=60, trust_env=False).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name in (name, name + "_total")
    )


def test_the_decode_engine_loads_the_prefill_engines_kv_and_answers_as_one_engine(
    tiny_model: Path, tmp_path: Path
) -> None:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": "Disaggregation splits prefill from decode. " * 6}
        ],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    tokenizer = load_tokenizer(tiny_model)
    ids = prompt_token_ids(tokenizer, "/v1/chat/completions", body)
    assert ids is not None and len(ids) > 2 * CHUNK
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", num_threads=1)
    try:
        expected = llm.generate(
            [ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        )[0]
    finally:
        llm.engine.shutdown()

    with running_server() as cache:
        config = tmp_path / "kvtier.yaml"
        data = {
            "chunk_size": CHUNK,
            "tiers": [{"type": "remote", "address": cache.address}],
            "connector": {"min_load_tokens": 16, "verify_fraction": 0},
        }
        config.write_text(yaml.safe_dump(data))
        with (
            engine_process(tiny_model, config, "prefill", tmp_path / "prefill.log") as prefill,
            engine_process(tiny_model, config, "decode", tmp_path / "decode.log") as decode,
        ):
            assert (
                httpx.get(prefill + "/health", timeout=60, trust_env=False).json()["role"]
                == "prefill"
            )
            rc = RouterConfig(
                engines=(EngineSpec(prefill, "prefill"), EngineSpec(decode, "decode")),
                policy="cache_aware",
                health_interval_s=0.5,
            )
            with BackgroundRouter(create_router_app(rc, tokenizer)) as router:
                for stream in (False, True):
                    r = httpx.post(router.url + "/v1/chat/completions", json={**body, "stream": stream},
                                   timeout=300, trust_env=False)  # fmt: skip
                    assert r.status_code == 200, r.text
                    assert r.headers["x-kvtier-prefill-engine"] == prefill
                    assert r.headers["x-kvtier-engine"] == decode
                    if stream:
                        import json

                        text = "".join(
                            (json.loads(line[5:])["choices"] or [{}])[0]
                            .get("delta", {})
                            .get("content")
                            or ""
                            for line in r.text.splitlines()
                            if line.startswith("data:") and "[DONE]" not in line
                        )
                    else:
                        text = r.json()["choices"][0]["message"]["content"]
                    assert text == expected.text
                # the first decode leg loaded all but the prompt's last token from the tier
                loaded = counter(decode, "kvtier_engine_external_loaded_tokens")
                assert loaded >= len(ids) - 1
                legs = {
                    s.labels["leg"]: s.value
                    for fam in text_string_to_metric_families(
                        httpx.get(router.url + "/metrics", timeout=60, trust_env=False).text
                    )
                    for s in fam.samples
                    if s.name == "kvtier_router_leg_seconds_count"
                }
                assert legs["prefill"] == 2 and legs["decode"] == 2
