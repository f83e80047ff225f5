"""bench/soak.py, briefly: its JSON and bars, and that its checks catch a broken store."""

from __future__ import annotations

import json
from typing import Any

import pytest
import soak

import kvtier.store

FIELDS = {"ops", "wrong_bytes_returned", "lost_acknowledged_writes", "faults_injected"}


def _soak(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    rc = soak.main(["--ops", "500", "--keys", "200", *args])
    lines = capsys.readouterr().out.strip().splitlines()
    return rc, json.loads(lines[-1])


def test_brief_soak_reports_and_passes_its_bars(capsys: pytest.CaptureFixture[str]) -> None:
    rc, r = _soak(capsys)
    assert FIELDS | {"errors_by_kind"} <= r.keys()
    assert r["ops"] == 500
    assert r["wrong_bytes_returned"] == 0 and r["lost_acknowledged_writes"] == 0
    assert r["faults_injected"] >= 3
    assert set(r["faults_by_kind"]) == {*soak.BARRIER_FAULTS, *soak.PHASE_FAULTS}
    assert r["errors_by_kind"]["escaped"] == 0
    assert r["errors_by_kind"].get("corrupt_reason:key_mismatch", 0) > 0  # a moved file, rejected
    assert r["errors_by_kind"].get("corrupt_blocks:disk", 0) > 0  # corrupt, truncated files
    assert min(r["acknowledged"].values()) > 0 and r["durability_reads"] > 0
    assert r["evictions"]["disk"] == 0 and r["server"]["disk_evictions"] == 0
    assert rc == 0 and all(r["bars"].values())


def test_soak_catches_a_store_that_serves_another_keys_block(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvtier.store, "check_key", lambda header, key: None)  # no key binding
    rc, r = _soak(capsys)
    assert r["wrong_bytes_returned"] > 0 and r["wrong_examples"]
    assert rc == 1 and not r["bars"]["wrong_bytes_returned == 0"]
