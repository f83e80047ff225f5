"""``metrics.port``: the process running the kvtier connector serves its metrics; kvtier serve refuses it."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvtier.config import CpuTierConfig, KvtierConfig, load_config
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine import LLM, SamplingParams
from kvtier.errors import ConfigError
from kvtier.server.loader import load_server_config
from tests.engine.tiny_models import write_tiny_model


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _sample(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start!r} not in the scrape")


def test_an_engine_with_the_connector_serves_kvtier_metrics(tmp_path: Path) -> None:
    model, _ = write_tiny_model(tmp_path / "tiny", "llama", seed=3)
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "chunk_size: 32\n"
        "tiers: [{type: cpu, capacity: 16MiB}]\n"
        "connector: {min_load_tokens: 16}\n"
        "metrics: {port: 0}\n"
    )
    llm = LLM(
        str(model),
        dtype="float32",
        device="cpu",
        block_size=16,
        num_threads=1,
        kv_connector="kvtier",
        kv_connector_config=str(config),
    )
    engine = llm.engine
    endpoint = engine.connector.metrics_endpoint  # type: ignore[attr-defined]
    try:
        assert endpoint is not None and endpoint.host == "127.0.0.1" and endpoint.port > 0
        prompt = list(range(3, 80))
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate([prompt], params)
        assert engine.connector.flush(timeout=60)  # type: ignore[attr-defined]
        # the second prompt finds the first's chunks; it reaches 40 tokens past them, so it is
        # looked up (a prompt G1 holds but for less than min_load_tokens is not)
        llm.generate([[*prompt, *range(100, 140)]], params)
        text = _scrape(endpoint.url)
        assert _sample(text, 'kvtier_lookups_total{outcome="miss"}') >= 1
        assert _sample(text, 'kvtier_lookups_total{outcome="partial"}') >= 1
        assert _sample(text, 'kvtier_lookup_tokens_total{kind="hit"}') >= 64
    finally:
        engine.shutdown()
    # stopped with the connector: the port is free again
    with pytest.raises(urllib.error.URLError):
        _scrape(endpoint.url)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the scrape left a TIME_WAIT
        s.bind((endpoint.host, endpoint.port))  # nobody listens there any more


def test_a_taken_port_is_a_config_error_naming_metrics_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = KvtierConfig(tiers=[CpuTierConfig(capacity=1 << 20)], metrics={"port": port})  # type: ignore[arg-type]
        with pytest.raises(
            ConfigError, match=rf"metrics.port: cannot serve /metrics on 127.0.0.1:{port}"
        ):
            KvtierConnector(config=config)


def test_no_port_no_endpoint() -> None:
    connector = KvtierConnector(config=KvtierConfig(tiers=[CpuTierConfig(capacity=1 << 20)]))
    try:
        assert connector.metrics_endpoint is None
    finally:
        connector.shutdown()


def test_the_host_is_configurable_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text("metrics: {port: 9400, host: 0.0.0.0}\n")
    assert load_config(path).metrics.host == "0.0.0.0"
    path.write_text("metrics: {port: 70000}\n")
    with pytest.raises(ConfigError, match=r"metrics\.port"):
        load_config(path)


def test_kvtier_serve_refuses_metrics_port(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("tiers: [{type: cpu, capacity: 1MiB}]\nmetrics: {port: 9400}\n")
    with pytest.raises(ConfigError, match=r"server\.http_port"):
        load_server_config(path, env={})
