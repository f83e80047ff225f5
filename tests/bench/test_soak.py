"""bench/soak.py, briefly: its JSON and bars, and that its checks catch a broken store."""

from __future__ import annotations

import json
from typing import Any

import pytest

import kvtier.store
from bench import soak
from kvtier.server_config import NamespaceConfig, ServerConfig

FIELDS = {
    "ops",
    "puts",
    "acknowledged",
    "read_back",
    "lost_acknowledged_writes",
    "wrong_bytes_returned",
    "poisoned_blocks_served",
    "faults_injected",
    "honest_p99_ms",
    "errors_by_kind",
}


def _soak(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    rc = soak.main(["--ops", "500", "--keys", "200", *args])
    lines = capsys.readouterr().out.strip().splitlines()
    return rc, json.loads(lines[-1])


def test_brief_soak_reports_and_passes_its_bars(capsys: pytest.CaptureFixture[str]) -> None:
    rc, r = _soak(capsys)
    assert r.keys() >= FIELDS
    assert r["ops"] == 500
    assert r["wrong_bytes_returned"] == 0 and r["lost_acknowledged_writes"] == 0
    assert r["faults_injected"] >= 3
    assert set(r["faults_by_kind"]) == {*soak.BARRIER_FAULTS, *soak.PHASE_FAULTS}
    assert r["errors_by_kind"]["escaped"] == 0
    assert r["errors_by_kind"].get("corrupt_reason:key_mismatch", 0) > 0  # a moved file, rejected
    assert r["errors_by_kind"].get("corrupt_blocks:disk", 0) > 0  # corrupt, truncated files
    assert min(r["acknowledged_by_tier"].values()) > 0 and r["durability_reads"] > 0
    assert 0.9 * r["puts"] <= r["acknowledged"] <= r["puts"]
    assert r["read_back"] == r["final_check"]["acknowledged_pairs"] > 0
    assert r["evictions"]["disk"] == 0 and r["server"]["disk_evictions"] == 0
    assert rc == 0 and all(r["bars"].values())


def test_soak_catches_a_store_that_serves_another_keys_block(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvtier.store, "check_key", lambda header, key: None)  # no key binding
    rc, r = _soak(capsys)
    assert r["wrong_bytes_returned"] > 0 and r["wrong_examples"]
    assert rc == 1 and not r["bars"]["wrong_bytes_returned == 0"]


def test_hostile_soak_poisons_every_key_and_serves_none_of_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, r = _soak(capsys, "--hostile")
    assert r["poison_stored_of_256_keys"] > 0  # the server holds poison, in its own slot
    assert r["poisoned_blocks_served"] == 0 and r["wrong_bytes_returned"] == 0
    assert r["faults_by_kind"]["poison"] > 0 and r["faults_by_kind"]["stalled_streams"] > 0
    assert rc == 0 and all(r["bars"].values())


def test_hostile_soak_catches_poison_served_when_every_writer_is_trusted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    original = soak.Rig._server_config

    def everyone_trusted(self: soak.Rig, *a: Any) -> ServerConfig:
        config = original(self, *a)
        return config.model_copy(update={"namespaces": [NamespaceConfig(name="fleet")]})

    monkeypatch.setattr(soak.Rig, "_server_config", everyone_trusted)
    rc, r = _soak(capsys, "--hostile")
    assert r["poisoned_blocks_served"] > 0
    assert rc == 1 and not r["bars"]["poisoned_blocks_served == 0"]
