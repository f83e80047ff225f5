"""Model-free helpers: requests and a step driver for block-manager/scheduler tests."""

from __future__ import annotations

from kvtier.engine.detokenizer import IncrementalDetokenizer
from kvtier.engine.request import Request
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.scheduler import Scheduler, SchedulerOutput


class NoText:
    """A tokenizer stand-in whose tokens render as nothing."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def make_request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    """A greedy request over ``tokens``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, tokens, params, None, IncrementalDetokenizer(NoText(), tokens))


def fake_step(sched: Scheduler, next_token: int = 7) -> SchedulerOutput:
    """Plans a step, pretends the forward pass ran, appends a token to sampling requests,
    and finishes requests that reached ``max_tokens``."""
    out = sched.schedule()
    sched.update_after_step(out)
    for c in out.chunks:
        if c.samples:
            req = c.request
            req.token_ids.append(next_token)
            if req.num_output_tokens >= req.params.max_tokens:
                sched.finish(req, "length")
    return out


def live_requests(sched: Scheduler) -> list[Request]:
    """Requests that may hold blocks."""
    return [*sched.running, *sched.waiting]
