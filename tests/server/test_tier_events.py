"""``GET /tier_events`` of the cache server: stored and removed blocks, by tenant."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvtier.config import DiskTierConfig, KvtierConfig
from tests.server.helpers import TOKENS, block, key, remote, running_server, server_config, tenants


def _get(base: str, token: str | None, **params: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.get(base + "/tier_events", params=params, headers=headers, timeout=30,
                     trust_env=False)  # fmt: skip


def _keys(page: dict, kind: str) -> list[str]:
    return [k for e in page["events"] if e["type"] == kind for k in e["keys"]]


def test_each_tenant_sees_its_own_blocks_stored_and_removed() -> None:
    config = server_config(tenants=tenants(), http_require_token=True, http_role="reader")
    with running_server(config) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        alpha = remote(server, token=TOKENS["alpha"])
        beta = remote(server, token=TOKENS["beta"])
        try:
            alpha.put([(key(1), block(1))])
            beta.put([(key(2), block(2))])
            alpha.delete([key(1)])
            page = _get(base, TOKENS["alpha"]).json()
            assert _keys(page, "stored") == [key(1).hex()]
            assert _keys(page, "removed") == [key(1).hex()]
            assert page["last_seq"] == 3 and page["reset"] is False
            assert _keys(_get(base, TOKENS["beta"]).json(), "stored") == [key(2).hex()]
            ops = _get(base, TOKENS["ops"]).json()  # admin: every tenant's
            assert _keys(ops, "stored") == [key(1).hex(), key(2).hex()]
            # a cursor of another server run: a snapshot of what is held, the tenant's only
            reset = _get(base, TOKENS["beta"], after=3, log_id="another-run").json()
            assert reset["reset"] is True and reset["snapshot"]["stored"] == [key(2).hex()]
            assert _get(base, None).status_code == 401
            assert _get(base, TOKENS["alpha"], after="x").status_code == 400
            # a long poll with nothing new answers empty after wait_s
            assert _get(base, TOKENS["beta"], after=3, wait_s=0.2).json()["events"] == []
        finally:
            alpha.close()
            beta.close()


def test_evictions_from_a_disk_tier_are_reported_without_reading_the_blocks(
    tmp_path: Path,
) -> None:
    size = len(block(0))
    store = KvtierConfig(tiers=[DiskTierConfig(path=tmp_path / "blocks", capacity=3 * size + 1024)])
    with running_server(server_config(), store) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        tier = remote(server)
        try:
            for i in range(5):
                tier.put([(key(i), block(i))])
            page = _get(base, None).json()
            removed = _keys(page, "removed")
            assert removed and set(removed) <= {key(i).hex() for i in range(2)}
            assert not any(tier.contains([bytes.fromhex(k) for k in removed]))
            assert server.tier_events.unnamed_evictions == 0
        finally:
            tier.close()
