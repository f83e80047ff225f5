"""``server.http_require_token``: the dashboard, /api/stats and /metrics need a tenant token."""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvtier.server.http import presented_token
from kvtier.server_config import ServerConfig
from tests.server.helpers import (
    TOKENS,
    block,
    key,
    remote,
    running_server,
    server_config,
    sha256,
    tenants,
)
from tests.server.test_dashboard import CHROMIUM, _chromium, _data_value

PROTECTED = ("/", "/dashboard", "/static/dashboard.js", "/api/stats", "/metrics")


def _get(url: str, authorization: str | None = None) -> tuple[int, bytes, list[str]]:
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read(), []
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get_all("WWW-Authenticate") or []


def _basic(token: str, user: str = "me") -> str:
    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()


def test_every_page_but_the_probes_needs_an_admin_token_by_default() -> None:
    with running_server(server_config(tenants=tenants(), http_require_token=True)) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        for path in PROTECTED:
            status, body, challenges = _get(base + path)
            assert status == 401, path
            assert b"a token is required" in body
            assert challenges[0].startswith("Basic realm=")  # what browsers can answer
            assert any(c.startswith("Bearer") for c in challenges)
            assert _get(base + path, "Bearer not-a-token")[0] == 401
            assert _get(base + path, _basic("not-a-token"))[0] == 401
            # alpha is a writer: known, but below the default http_role (admin)
            status, body, _ = _get(base + path, f"Bearer {TOKENS['alpha']}")
            assert status == 403 and b"writer is below admin" in body
            assert _get(base + path, f"Bearer {TOKENS['ops']}")[0] == 200
            assert _get(base + path, _basic(TOKENS["ops"]))[0] == 200
        for probe in ("/healthz", "/readyz"):
            assert _get(base + probe)[0] == 200
        # an unknown path is refused before it is looked up
        assert _get(base + "/nope")[0] == 401
        assert _get(base + "/nope", f"Bearer {TOKENS['ops']}")[0] == 404
        status, body, _ = _get(base + "/metrics", f"Bearer {TOKENS['ops']}")
        assert b"kvtier_server_ready 1.0" in body
        status, body, _ = _get(base + "/api/stats", _basic(TOKENS["ops"], user=""))
        assert status == 200 and json.loads(body)["ready"] is True


def test_http_role_reader_admits_every_tenant() -> None:
    config = server_config(tenants=tenants(), http_require_token=True, http_role="reader")
    with running_server(config) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        for name in ("alpha", "beta", "ops"):
            assert _get(base + "/metrics", f"Bearer {TOKENS[name]}")[0] == 200


def test_a_tenant_sees_only_its_own_traffic_unless_it_sees_everyone() -> None:
    roles = {"alpha": "writer", "beta": "writer", "ops": "admin"}
    config = server_config(tenants=tenants(roles), http_require_token=True, http_role="reader")
    with running_server(config) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        for name in ("alpha", "beta"):
            tier = remote(server, TOKENS[name])
            tier.put([(key(1), block(1))])
            tier.close()

        def rows(token: str) -> set[str]:
            status, body, _ = _get(base + "/api/stats", f"Bearer {token}")
            assert status == 200
            return {t["name"] for t in json.loads(body)["tenants"]}

        deadline = time.monotonic() + 30
        while rows(TOKENS["ops"]) < {"alpha", "beta"}:
            assert time.monotonic() < deadline, "the stats sampler never saw both tenants"
            time.sleep(0.2)
        assert rows(TOKENS["alpha"]) == {"alpha"}
        _, text, _ = _get(base + "/metrics", f"Bearer {TOKENS['alpha']}")
        tenants_seen = set(re.findall(rb'tenant="([^"]+)"', text))
        assert tenants_seen == {b"alpha"}
        assert b"kvtier_server_ready 1.0" in text  # figures without a tenant stay
        _, text, _ = _get(base + "/metrics", f"Bearer {TOKENS['ops']}")
        assert {b"alpha", b"beta"} <= set(re.findall(rb'tenant="([^"]+)"', text))


def test_an_open_server_still_needs_a_token_on_http_when_required() -> None:
    config = server_config(tenants=tenants(), open=True, http_require_token=True)
    with running_server(config) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        assert _get(base + "/metrics")[0] == 401  # no anonymous admin on the HTTP side
        assert _get(base + "/metrics", f"Bearer {TOKENS['ops']}")[0] == 200


def test_without_the_option_http_stays_open() -> None:
    with running_server(server_config(tenants=tenants(), open=False)) as server:
        assert _get(f"http://127.0.0.1:{server.http_port}/metrics")[0] == 200


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        ("", None),
        ("Bearer abc", "abc"),
        ("bearer   abc ", "abc"),
        ("Bearer", None),
        ("Token abc", None),
        (_basic("abc"), "abc"),
        (_basic("a:b:c"), "a:b:c"),  # only the first colon separates the name
        ("Basic " + base64.b64encode(b"no-colon").decode(), None),
        ("Basic !!!not-base64", None),
        (_basic(""), None),
    ],
)
def test_the_token_of_an_authorization_header(header: str | None, token: str | None) -> None:
    assert presented_token(header) == token


def test_config_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="http_role has no effect without http_require_token"):
        ServerConfig(http_role="reader")
    with pytest.raises(ValueError, match="no tenant has role admin"):
        ServerConfig(http_require_token=True, tenants=tenants({"alpha": "writer"}))
    with pytest.raises(ValueError, match="no tenant has role reader"):
        ServerConfig(http_require_token=True, http_role="reader")  # no tenants at all
    ok = ServerConfig(
        http_require_token=True,
        http_role="writer",
        tenants=[{"name": "a", "token_sha256": sha256("t"), "role": "writer"}],  # type: ignore[list-item]
    )
    assert ok.http_role == "writer"


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium on PATH (apt-get install -y chromium)")
def test_the_dashboard_works_in_a_browser_given_the_token(tmp_path: Path) -> None:
    """Chromium opens the token-protected page with the token as Basic password; its polls
    of /api/stats carry it too, so the page fills with live figures. Without it: nothing."""
    config = server_config(tenants=tenants(), http_require_token=True)
    with running_server(config) as server:
        tier = remote(server, token=TOKENS["alpha"])
        try:
            tier.put([(key(1), block(1))])
            tier.prefix_length([key(1), key(2)])
        finally:
            tier.close()
        time.sleep(1.5)  # a history sample with the traffic in it
        signed_in = f"http://ops:{TOKENS['ops']}@127.0.0.1:{server.http_port}/"
        r = _chromium(signed_in, tmp_path / "profile-in", "--dump-dom")
        assert r.returncode == 0, r.stderr[-2000:]
        dom = r.stdout
        refused = _chromium(
            f"http://127.0.0.1:{server.http_port}/", tmp_path / "profile-out", "--dump-dom"
        )
    assert int(re.search(r'data-updates="(\d+)"', dom).group(1)) >= 2  # type: ignore[union-attr]
    assert float(_data_value(dom, "total-lookup-hit-rate")) == 0.5  # 1 of 2 keys
    assert 'data-tenant="alpha"' in dom and "serving" in dom
    assert refused.returncode == 0 and 'id="kpi-lookup-hit-rate"' not in refused.stdout
