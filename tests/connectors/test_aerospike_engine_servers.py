"""Two ``kvtier engine serve`` processes sharing the test run's real Aerospike cluster.

Engine A answers a long prompt and saves its KV to the cluster (2 nodes,
replication-factor 2, the deployed namespace); engine B, another process,
answers the same prompt loading that KV: its answer equals a cold engine's
and the prompt's chunks show as cached tokens. Then the same with a node
killed (SIGKILL) between A's save and B's load: B reads the replica.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

from kvtier.engine import LLM, SamplingParams
from tests.engine.tiny_models import write_tiny_model
from tests.support.aerospike_target import CLUSTER, backend, make_target, session_cluster
from tests.support.timeouts import aerospike_timeouts, scaled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(backend() != CLUSTER, reason="kills a node: needs ../shared/aerospike"),
]
CHUNK = 32
MAX_TOKENS = 6


@contextmanager
def engine_servers(model: Path, config: Path, logs: list[Path]) -> Iterator[list[str]]:
    """One ``kvtier engine serve`` per log file, started together; their URLs."""
    cmd = [
        sys.executable, "-m", "kvtier.cli", "engine", "serve", "-m", str(model), "--port", "0",
        "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
        "--kv-cache-memory", "8MiB", "--threads", "1",
        "--kv-connector", "kvtier", "--kvtier-config", str(config),
    ]  # fmt: skip
    procs = []
    for log in logs:
        with log.open("w") as out:
            procs.append(
                subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
            )
    try:
        urls: list[str] = []
        deadline = time.monotonic() + scaled(45)
        for proc, log in zip(procs, logs, strict=True):
            url = None
            while url is None:
                assert proc.poll() is None, f"engine exited: {log.read_text()}"
                assert time.monotonic() < deadline, f"engine did not start: {log.read_text()}"
                for line in log.read_text().splitlines():
                    if " on http://" in line:
                        url = line.split(" on ", 1)[1].split()[0]
                time.sleep(0.1)
            urls.append(url)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def complete(url: str, prompt: list[int]) -> tuple[str, int]:
    """(text, cached prompt tokens) of a greedy completion."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=scaled(60), trust_env=False)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_for_records(count: Any, at_least: int) -> None:
    """Until the engine's asynchronous save has landed ``at_least`` records (bounded)."""
    deadline = time.monotonic() + scaled(15)
    while count() < at_least:
        assert time.monotonic() < deadline, f"{count()} records, expected {at_least}"
        time.sleep(0.1)


def test_two_engine_servers_share_a_long_prefix_and_survive_a_node_kill(
    tmp_path: Path,
) -> None:
    model, _ = write_tiny_model(tmp_path / "tiny", "llama", seed=29)
    g = torch.Generator().manual_seed(29)
    long_prompts = [torch.randint(3, 380, (8 * CHUNK + 3,), generator=g).tolist() for _ in range(2)]
    plain = LLM(str(model), dtype="float32", device="cpu", num_threads=1)
    try:
        cold = [
            o.text
            for o in plain.generate(
                long_prompts,
                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            )
        ]
    finally:
        plain.engine.shutdown()

    cluster = session_cluster()
    cluster.heal()
    target = make_target()
    config = tmp_path / "kvtier.yaml"
    tier = {
        "type": "aerospike",
        "hosts": cluster.seeds,
        "namespace": target.namespace,
        "set_name": target.set_name,
        "cluster_name": cluster.settings.cluster_name,
        "ttl_s": 3600,
        **aerospike_timeouts(),
    }
    config.write_text(
        yaml.safe_dump(
            {
                "chunk_size": CHUNK,
                "tiers": [tier],
                "connector": {"min_load_tokens": CHUNK, "verify_fraction": 0},
            }
        )
    )
    full_chunks = 8 * CHUNK
    try:
        with engine_servers(model, config, [tmp_path / "a.log", tmp_path / "b.log"]) as (a, b):
            first, second = long_prompts
            assert complete(a, first) == (cold[0], 0)
            wait_for_records(target.record_count, 9)  # 8 chunks and the prompt's tail
            text, cached = complete(b, first)
            assert text == cold[0] and cached >= full_chunks  # loaded A's KV

            assert complete(a, second) == (cold[1], 0)
            wait_for_records(target.record_count, 18)
            cluster.kill(1)
            text, cached = complete(b, second)
            assert text == cold[1] and cached >= full_chunks  # from the replica
    finally:
        cluster.heal()
        target.close()
