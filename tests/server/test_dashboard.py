"""The dashboard page renders in headless Chromium against a live server with traffic.

Needs Debian's ``chromium`` (``apt-get install -y chromium``); skipped without it.
Saves ``artifacts/dashboard.png`` (git-ignored) for a person to look at.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig
from tests.server.helpers import TOKENS, block, key, remote, running_server, server_config, tenants

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=4000",
            *extra,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )


def _data_value(dom: str, element_id: str) -> str:
    m = re.search(rf'id="{element_id}"[^>]*data-value="([^"]*)"', dom) or re.search(
        rf'data-value="([^"]*)"[^>]*id="{element_id}"', dom
    )
    assert m, f"#{element_id} not in the rendered page"
    return m.group(1)


def test_http_endpoints_serve_the_page_metrics_and_stats() -> None:
    with running_server(server_config(tenants=tenants())) as server:
        tier = remote(server, token=TOKENS["alpha"])
        tier.put([(key(1), block(1))])
        tier.prefix_length([key(1), key(2)])
        tier.close()
        base = f"http://127.0.0.1:{server.http_port}"
        with urllib.request.urlopen(base + "/", timeout=5) as r:
            assert b"kvtier cache server" in r.read()
        for name in ("dashboard.js", "dashboard.css"):
            with urllib.request.urlopen(f"{base}/static/{name}", timeout=5) as r:
                assert r.status == 200
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'kvtier_server_requests_total{code="OK",method="Lookup",tenant="alpha"} 1.0' in text
        assert 'kvtier_lookup_keys_total{kind="hit"} 1.0' in text  # the store's metrics too
        with urllib.request.urlopen(base + "/api/stats", timeout=5) as r:
            stats = json.load(r)
        assert stats["totals"]["lookup_hits"] == 1 and stats["totals"]["lookup_keys"] == 2
        # the put went over the data plane, and counts like any call
        assert stats["data_port"] == server.data_port and stats["totals"]["bytes_in"] == len(
            block(1)
        )
        assert 'method="data.Put",tenant="alpha"} 1.0' in text
        assert [t["name"] for t in stats["tenants"]] == ["alpha"]
        for bad in ("/static/../config.py", "/nope", "/static/.hidden"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + bad, timeout=5)
            assert e.value.code == 404
        server.service.drain()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/readyz", timeout=5)
        assert e.value.code == 503


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium on PATH (apt-get install -y chromium)")
def test_dashboard_renders_live_hit_rates_in_chromium(tmp_path: Path) -> None:
    store_config = KvtierConfig(
        tiers=[
            CpuTierConfig(capacity=200_000),
            DiskTierConfig(path=tmp_path / "disk", capacity=64 << 20),
        ]
    )
    with running_server(server_config(tenants=tenants()), store_config) as server:
        stop = threading.Event()
        failures: list[BaseException] = []

        def traffic(token: str, base: int) -> None:
            tier = remote(server, token=token)
            try:
                i = 0
                while not stop.is_set() and i < 2000:
                    tier.put([(key(base + i), block(base + i, tokens=48))])
                    window = [key(base + j) for j in range(max(0, i - 6), i + 3)]
                    tier.prefix_length(window)
                    tier.get(window)
                    i += 1
                    time.sleep(0.01)
            except BaseException as e:
                failures.append(e)
            finally:
                tier.close()

        workers = [
            threading.Thread(target=traffic, args=(TOKENS["alpha"], 0)),
            threading.Thread(target=traffic, args=(TOKENS["beta"], 100_000)),
        ]
        for w in workers:
            w.start()
        try:
            time.sleep(2.5)  # a few history samples with traffic in them
            url = f"http://127.0.0.1:{server.http_port}/"
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "dashboard.png"
            shot.unlink(missing_ok=True)
            r = _chromium(
                url, tmp_path / "profile-shot", "--window-size=1400,1100", f"--screenshot={shot}"
            )
            assert r.returncode == 0, r.stderr[-2000:]
            assert shot.exists() and shot.stat().st_size > 20_000
            r = _chromium(url, tmp_path / "profile-dom", "--dump-dom")
            assert r.returncode == 0, r.stderr[-2000:]
            dom = r.stdout
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=30)
        assert not failures, failures
        # the traffic went over the data plane, which the header names
        assert f"data plane :{server.data_port}" in dom
    # values the page's script wrote into the DOM
    assert float(_data_value(dom, "kpi-lookup-hit-rate")) > 0
    assert float(_data_value(dom, "kpi-get-hit-rate")) > 0
    assert float(_data_value(dom, "total-lookup-hit-rate")) > 0
    assert float(_data_value(dom, "kpi-bytes-in")) > 0
    points = [int(p) for p in re.findall(r'class="chart"[^>]*data-points="(\d+)"', dom)]
    points += [int(p) for p in re.findall(r'data-points="(\d+)"[^>]*class="chart"', dom)]
    assert len(points) == 4 and min(points) > 0, points  # all four charts drew lines
    assert 'data-tier="cpu"' in dom and 'data-tier="disk"' in dom
    assert 'data-tenant="alpha"' in dom and 'data-tenant="beta"' in dom
    assert "serving" in dom
