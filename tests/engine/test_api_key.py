"""``kvtier engine serve --api-key``: every route but /health and /metrics needs the key."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from kvtier.engine import AsyncLLMEngine, EngineConfig
from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.server import BackgroundServer, ServeOptions, create_app
from tests.engine.test_server import ENGINE

KEY = "sk-kvtier-test-0123456789abcdef"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


class _Served:
    def __init__(self, model: Path, api_key: str | None) -> None:
        self.registry = CollectorRegistry()
        self.engine = AsyncLLMEngine(
            EngineConfig(model=str(model), **ENGINE), EngineMetrics(self.registry)
        )
        self.engine.start()
        try:
            app = create_app(
                self.engine, served_model_name="tiny", registries=[self.registry], api_key=api_key
            )
            self.server = BackgroundServer(app).start()
        except BaseException:
            self.engine.shutdown()
            raise
        self.url = self.server.url

    def close(self) -> None:
        self.server.close()
        self.engine.shutdown()


@pytest.fixture(scope="module")
def served(tiny_llama: Path) -> Iterator[_Served]:
    s = _Served(tiny_llama, KEY)
    yield s
    s.close()


def _post(url: str, path: str, body: dict[str, Any], auth: str | None) -> httpx.Response:
    headers = {"Authorization": auth} if auth is not None else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("auth", "message"),
    [
        (None, "no API key provided"),
        ("Bearer wrong-key", "incorrect API key"),
        (f"Bearer {KEY}x", "incorrect API key"),
        (f"Bearer {KEY[:-1]}", "incorrect API key"),
        (f"Basic {KEY}", "must be 'Bearer <key>'"),
        (KEY, "must be 'Bearer <key>'"),
        ("Bearer", "incorrect API key"),
    ],
)
def test_a_missing_or_wrong_key_is_401_with_an_openai_error(
    served: _Served, auth: str | None, message: str
) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "Hi"})):
        r = _post(served.url, path, body, auth)
        assert r.status_code == 401, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert message in error["message"] and KEY not in error["message"]
        assert r.headers["www-authenticate"].startswith("Bearer")
    r = httpx.get(served.url + "/v1/models", headers={"Authorization": auth or ""}, timeout=30)
    assert r.status_code == 401


def test_the_right_key_serves_and_health_and_metrics_stay_open(served: _Served) -> None:
    auth = f"Bearer {KEY}"
    assert _post(served.url, "/v1/chat/completions", CHAT, None).status_code == 401
    r = _post(served.url, "/v1/chat/completions", CHAT, auth)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = _post(served.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, f"bearer  {KEY}")
    assert r.status_code == 200  # the scheme is case-insensitive, as HTTP says
    models = httpx.get(served.url + "/v1/models", headers={"Authorization": auth}, timeout=30)
    assert models.json()["data"][0]["id"] == "tiny"
    assert httpx.get(served.url + "/health", timeout=30).json() == {"status": "ok"}
    metrics = httpx.get(served.url + "/metrics", timeout=30)
    assert metrics.status_code == 200
    # refusals are counted like any answer
    assert 'kvtier_engine_http_requests_total{endpoint="/v1/chat/completions",status="4xx"}' in (
        metrics.text
    )


def test_unknown_paths_need_the_key_too(served: _Served) -> None:
    assert httpx.get(served.url + "/v2/anything", timeout=30).status_code == 401
    assert httpx.get(served.url + "//v1/models", timeout=30).status_code == 401
    known = httpx.get(
        served.url + "/v2/anything", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert known.status_code == 404


def test_the_openai_client_with_and_without_the_key(served: _Served) -> None:
    good = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    bad = openai.OpenAI(base_url=served.url + "/v1", api_key="nope", max_retries=0, timeout=60)
    try:
        out = good.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert e.value.status_code == 401
    finally:
        good.close()
        bad.close()


def test_no_key_configured_serves_without_one(tiny_llama: Path) -> None:
    s = _Served(tiny_llama, None)
    try:
        assert _post(s.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, None).is_success
    finally:
        s.close()


@pytest.mark.parametrize("key", ["", " padded ", "tab\there", "naïve"])
def test_unusable_keys_are_refused_when_the_app_is_built(key: str) -> None:
    with pytest.raises(ValueError, match="API key"):
        create_app(object(), served_model_name="x", api_key=key)  # type: ignore[arg-type]


def _serve_cli(
    monkeypatch: pytest.MonkeyPatch, model: Path, args: list[str], env: dict[str, str]
) -> Any:
    """Runs ``kvtier engine serve`` up to serve_forever; returns (result, the options it got)."""
    from kvtier.cli import main
    from kvtier.engine.server import runner

    seen: list[ServeOptions] = []
    monkeypatch.setattr(
        runner, "serve_forever", lambda config, options, quiet: seen.append(options)
    )
    monkeypatch.delenv("KVTIER_API_KEY", raising=False)
    result = CliRunner().invoke(main, ["engine", "serve", "-q", "-m", str(model), *args], env=env)
    return result, seen


def test_the_cli_takes_the_key_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: Path
) -> None:
    result, seen = _serve_cli(monkeypatch, tiny_llama, ["--api-key", KEY], {})
    assert result.exit_code == 0, result.output
    assert seen[0].api_key == KEY and KEY not in repr(seen[0])
    result, seen = _serve_cli(monkeypatch, tiny_llama, [], {"KVTIER_API_KEY": KEY})
    assert result.exit_code == 0, result.output
    assert seen[0].api_key == KEY
    result, seen = _serve_cli(monkeypatch, tiny_llama, [], {})
    assert result.exit_code == 0 and seen[0].api_key is None
    result, seen = _serve_cli(monkeypatch, tiny_llama, [], {"KVTIER_API_KEY": ""})
    assert result.exit_code == 2 and not seen
    assert "KVTIER_API_KEY is set but empty" in result.output
    result, seen = _serve_cli(monkeypatch, tiny_llama, ["--api-key", " x"], {})
    assert result.exit_code == 2 and "whitespace" in result.output


DOC = Path(__file__).resolve().parents[2] / "docs" / "engine-server.md"


def test_the_docs_api_key_example(served: _Served) -> None:
    """The curl line of the API-key example in docs/engine-server.md, run as written."""
    import re
    import shutil
    import subprocess

    (block,) = [
        b
        for b in re.findall(r"```sh\n(.*?)```", DOC.read_text(), flags=re.S)
        if "KVTIER_API_KEY" in b
    ]
    (command,) = [c for c in block.splitlines() if c.startswith("curl ")]
    live = command.replace("http://127.0.0.1:8000", served.url)
    if shutil.which("curl") is None:
        pytest.skip("no curl binary")
    env = {"PATH": os.environ["PATH"], "KVTIER_API_KEY": KEY}
    done = subprocess.run(["bash", "-c", live], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["data"][0]["id"] == "tiny"
    env["KVTIER_API_KEY"] = "wrong"
    done = subprocess.run(["bash", "-c", live], capture_output=True, text=True, timeout=60, env=env)
    assert json.loads(done.stdout)["error"]["code"] == "invalid_api_key"
