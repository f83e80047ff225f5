"""``bench/serve_router.py``: its bars and its long-prompt workload (no servers started)."""

from __future__ import annotations

from bench import serve_router


def _run(hit: float | None, ttft_p99: float, itl_p99: float) -> dict[str, float | None]:
    return {"hit_rate": hit, "ttft_p99_s": ttft_p99, "itl_p99_s": itl_p99}


def test_the_bars_compare_cache_aware_with_round_robin_and_pd_with_colocated() -> None:
    policies = {"round_robin": _run(0.40, 2.0, 0.1), "cache_aware": _run(0.60, 1.5, 0.1)}
    pd = {"colocated": _run(None, 3.0, 1.2), "pd": _run(None, 3.5, 0.2)}
    assert serve_router.checks(policies, pd) == {
        "cache_aware_hit_rate_ge_round_robin_plus_0.15": True,
        "cache_aware_ttft_p99_le_round_robin": True,
        "pd_itl_p99_lt_colocated": True,
    }
    policies["cache_aware"] = _run(0.50, 2.5, 0.1)
    pd["pd"] = _run(None, 3.5, 1.3)
    assert set(serve_router.checks(policies, pd).values()) == {False}
    policies["round_robin"] = _run(None, 2.0, 0.1)
    assert (
        serve_router.checks(policies, {})["cache_aware_hit_rate_ge_round_robin_plus_0.15"] is None
    )


def test_long_prompts_are_unique_documents_of_the_asked_length() -> None:
    args = serve_router.parse_args(["--quick", "--pd-prompt-tokens", "200", "--pd-requests", "4"])
    assert args.users % 2 == 1  # round robin must not keep a user on one engine by accident
    count = lambda text: len(text.split())  # noqa: E731 - one token per word
    w = serve_router.long_prompts(args, count, seed=3)
    assert w.planned == 4 and w.max_tokens == args.pd_answer_tokens
    texts = [lane.session.messages()[0]["content"] for lane in w.lanes]
    assert len(set(texts)) == 4
    arrivals = [lane.arrivals[0] for lane in w.lanes]
    assert arrivals == sorted(arrivals)
