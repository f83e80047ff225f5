"""The shared tier's event log: cursors, runs of one kind, snapshots, filters, long polls."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.tier_events import TierEventLog, parse_query


def k(i: int) -> bytes:
    return bytes([i]) * 16


def s(i: int) -> bytes:
    """The scoped key the server stores ``k(i)`` under (any other 16 bytes)."""
    return bytes([100 + i]) * 16


def test_a_reader_follows_the_log_with_a_cursor() -> None:
    log = TierEventLog()
    log.record("stored", [(s(1), k(1)), (s(2), k(2))])
    log.record("removed", [(s(1), k(1))])
    log.record("stored", [(s(3), k(3))])
    page = log.read(0)
    assert not page.reset and page.last_seq == 4
    assert page.events == [
        (2, "stored", [k(1), k(2)]),
        (3, "removed", [k(1)]),
        (4, "stored", [k(3)]),
    ]
    assert log.read(2).events == [(3, "removed", [k(1)]), (4, "stored", [k(3)])]
    assert log.read(4).events == [] and log.read(4).last_seq == 4
    part = log.read(0, limit=2)  # at most 2 entries: the cursor stops after them
    assert part.last_seq == 2 and part.events == [(2, "stored", [k(1), k(2)])]
    body = page.to_json()
    assert body["events"][1] == {"seq": 3, "type": "removed", "keys": [k(1).hex()]}
    assert body["log_id"] == log.log_id and "snapshot" not in body


def test_a_reader_that_fell_behind_or_comes_from_another_log_gets_a_snapshot() -> None:
    log = TierEventLog(capacity=2, max_keys=2)
    log.record("stored", [(s(i), k(i)) for i in range(1, 4)])  # k(1) leaves the snapshot set
    log.record("removed", [(s(3), k(3))])
    page = log.read(0)  # entries 1-2 left the ring
    assert page.reset and page.events == [] and page.last_seq == 4
    assert page.snapshot == [k(2)]
    assert log.read(4, log_id="a-restarted-server").reset
    assert log.read(99).reset  # a cursor from the future
    assert not log.read(3).reset
    assert page.to_json()["snapshot"] == {"stored": [k(2).hex()]}


def test_a_filter_hides_other_tenants_entries_but_the_cursor_moves_past_them() -> None:
    log = TierEventLog()
    log.record("stored", [(s(1), k(1)), (s(2), k(2))])
    mine = log.read(0, visible=lambda scoped, key: scoped == s(2))
    assert mine.events == [(2, "stored", [k(2)])] and mine.last_seq == 2
    log.record("removed", [(s(1), k(1))])
    assert log.read(2, visible=lambda scoped, key: scoped == s(2)).events == []
    assert log.read(2, visible=lambda scoped, key: scoped == s(2)).last_seq == 3


def test_a_long_poll_wakes_when_an_entry_arrives() -> None:
    log = TierEventLog()
    threading.Timer(0.2, log.record, ("stored", [(s(1), k(1))])).start()
    t0 = time.monotonic()
    log.wait(0, 20.0)
    assert time.monotonic() - t0 < 10.0 and log.last_seq == 1
    t0 = time.monotonic()
    log.wait(1, 0.1)  # nothing new: the timeout
    assert time.monotonic() - t0 >= 0.09


def test_queries_are_checked() -> None:
    assert parse_query({}) == (0, None, 0.0, 4096)
    assert parse_query({"after": ["7"], "log_id": ["x"], "wait_s": ["2.5"], "limit": ["10"]}) == (
        7, "x", 2.5, 10
    )  # fmt: skip
    for bad in ({"after": ["-1"]}, {"after": ["x"]}, {"wait_s": ["31"]}, {"wait_s": ["nan"]},
                {"limit": ["0"]}):  # fmt: skip
        with pytest.raises(ValueError):
            parse_query(bad)
    with pytest.raises(ValueError):
        TierEventLog(capacity=0)
