"""Token sampling: greedy, temperature, top-k, top-p, per-request generators, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    """The token chosen for one row, and its logprobs when asked for.

    Attributes:
        token_id: The sampled token.
        logprob: log p(token) under the raw model distribution, or None.
        top_logprobs: ``(token_id, logprob)`` of the most likely tokens, or None.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks (to ``-inf``) tokens outside the top-k and outside the top-p nucleus.

    Args:
        logits: ``[V]`` or ``[N, V]`` float logits (already temperature-scaled).
        top_k: Keep the ``top_k`` largest (0 or >= V: off). Ties at the k-th
            value are all kept.
        top_p: Keep the smallest set of most likely tokens whose probability
            reaches ``top_p`` (1.0: off). The most likely token is always kept.

    Returns:
        A new tensor with the same shape.
    """
    out = logits.clone()
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(out, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # mass of the tokens strictly more likely than each one
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[SampleResult]:
    """Picks one token per row.

    Args:
        logits: ``[N, V]`` float32 raw logits.
        params: Sampling parameters of each row.
        generators: A seeded generator per row (None uses torch's global RNG).

    Returns:
        One ``SampleResult`` per row.
    """
    n = logits.shape[0]
    greedy_rows = [i for i in range(n) if params[i].greedy]
    chosen = [0] * n
    if greedy_rows:
        if len(greedy_rows) == n:
            tokens = logits.argmax(dim=-1).tolist()
            chosen = list(tokens)
        else:
            idx = torch.tensor(greedy_rows, device=logits.device)
            for i, t in zip(
                greedy_rows, logits.index_select(0, idx).argmax(dim=-1).tolist(), strict=True
            ):
                chosen[i] = t
    for i in range(n):
        p = params[i]
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        row = apply_top_k_top_p(row, p.top_k, p.top_p)
        probs = row.softmax(dim=-1)
        chosen[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())

    want = [i for i in range(n) if params[i].logprobs is not None]
    results = [SampleResult(token_id=t) for t in chosen]
    if want:
        idx = torch.tensor(want, device=logits.device)
        logp = torch.log_softmax(logits.index_select(0, idx), dim=-1)
        k = max(params[i].logprobs or 0 for i in want)
        top_vals, top_ids = logp.topk(k, dim=-1) if k > 0 else (None, None)
        for j, i in enumerate(want):
            res = results[i]
            res.logprob = float(logp[j, res.token_id])
            nk = params[i].logprobs or 0
            if nk and top_vals is not None and top_ids is not None:
                res.top_logprobs = list(
                    zip(top_ids[j, :nk].tolist(), top_vals[j, :nk].tolist(), strict=True)
                )
            else:
                res.top_logprobs = []
    return results
