"""vLLM's scheduler output read into the connector core's step calls (no vLLM import).

Each step vLLM hands its connector a ``SchedulerOutput``; what the core needs
of it is, for every request scheduled, its block table (whole for a new or
resumed request, the blocks added otherwise), how many tokens it had computed
and how many it computes now::

    scheduled_new_reqs[i]         req_id, block_ids ([ids],), num_computed_tokens
    scheduled_cached_reqs         req_ids[i], new_block_ids[i] (None in decode),
                                  num_computed_tokens[i], resumed_req_ids
    num_scheduled_tokens[req_id]  tokens this step computes
"""

from __future__ import annotations

from typing import Any

from kvtier.connectors.plan import StepPlan
from kvtier.connectors.scheduler_side import ConnectorScheduler


def build_step_plan(core: ConnectorScheduler, scheduler_output: Any) -> StepPlan:
    """This step's loads, and the saves of what its forward pass completes."""
    so = scheduler_output
    for new in so.scheduled_new_reqs:
        core.set_blocks(new.req_id, new.block_ids[0])
        _plan(core, new.req_id, new.num_computed_tokens, so.num_scheduled_tokens.get(new.req_id, 0))
    cached = so.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        if rid in cached.resumed_req_ids:
            core.set_blocks(rid, new_ids[0] if new_ids is not None else [])
        elif new_ids is not None:
            core.set_blocks(rid, new_ids[0], append=True)
        _plan(core, rid, cached.num_computed_tokens[i], so.num_scheduled_tokens.get(rid, 0))
    return core.take_plan()


def _plan(core: ConnectorScheduler, request_id: str, computed: int, scheduled: int) -> None:
    prompt = core.num_prompt_tokens(request_id)
    if prompt is None or scheduled <= 0:
        return
    core.plan_saves(request_id, computed + scheduled, decode=computed >= prompt)
