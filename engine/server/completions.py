"""``POST /v1/completions``: text completion of one or more prompts."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from kvtier.engine.outputs import RequestOutput
from kvtier.engine.server.body import parse_body, read_body
from kvtier.engine.server.generation import Generation
from kvtier.engine.server.inputs import check_model, completion_inputs
from kvtier.engine.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from kvtier.engine.server.responses import completion_logprobs, usage_of
from kvtier.engine.server.state import ServerState
from kvtier.engine.server.streaming import collect_unless_disconnected, start_stream


async def create_completion(request: Request, state: ServerState) -> Response:
    """Answers one completion request (JSON or, with ``stream``, server-sent events)."""
    release = state.acquire()
    try:
        req = parse_body(await read_body(request, state.limits.max_body_bytes), CompletionRequest)
        check_model(req.model, state.served_names)
        engine = state.engine
        # NOTE: tokenizing (and rendering a template) can take a while for a
        # long prompt; a worker thread keeps the event loop streaming meanwhile.
        inputs = await run_in_threadpool(
            completion_inputs, req, engine.tokenizer, engine.max_model_len
        )
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        generation = Generation(engine, rid, inputs.prompts, inputs.params)
        if req.stream:
            stream = _CompletionStream(state, req, rid, created, len(inputs.prompts))
            response = await start_stream(generation, stream.render, stream.tail, release)
            release = _noop  # the response releases the slot when it ends
            return response
        finals = await collect_unless_disconnected(request, generation)
        choices = [_choice(state, req, i, out) for i, out in enumerate(finals)]
        body = CompletionResponse(
            id=rid,
            created=created,
            model=req.model or state.served_model_name,
            choices=choices,
            usage=usage_of(finals),
        )
        return JSONResponse(body.model_dump())
    finally:
        release()


def _noop() -> None:
    return None


def _choice(
    state: ServerState, req: CompletionRequest, index: int, out: RequestOutput
) -> CompletionChoice:
    logprobs = None
    if req.logprobs is not None and out.logprobs is not None:
        logprobs = completion_logprobs(state.engine.tokenizer, out.logprobs, 0)
    return CompletionChoice(
        index=index,
        text=out.text,
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        token_ids=list(out.token_ids) if req.return_token_ids else None,
    )


class _CompletionStream:
    """Turns engine outputs into ``text_completion`` chunks.

    With ``stream_options.include_usage`` a final chunk with no choices
    carries the usage of every prompt; with ``continuous_usage_stats`` each
    chunk carries the usage of its choice so far.
    """

    def __init__(
        self, state: ServerState, req: CompletionRequest, rid: str, created: int, n: int
    ) -> None:
        self.state = state
        self.req = req
        self.rid = rid
        self.created = created
        self.model = req.model or state.served_model_name
        self.sent_logprobs = [0] * n
        # characters of the tokens whose logprobs were sent (text_offset of the next one)
        self.token_chars = [0] * n
        self.last: list[RequestOutput | None] = [None] * n
        self.continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def _chunk(
        self, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def render(self, index: int, out: RequestOutput) -> Iterable[BaseModel]:
        self.last[index] = out
        logprobs = None
        if self.req.logprobs is not None and out.logprobs is not None:
            new = out.logprobs[self.sent_logprobs[index] :]
            self.sent_logprobs[index] = len(out.logprobs)
            if new:
                logprobs = completion_logprobs(
                    self.state.engine.tokenizer, new, self.token_chars[index]
                )
                self.token_chars[index] += sum(len(e.token) for e in new)
        token_ids = list(out.delta_token_ids) if self.req.return_token_ids else None
        if not out.delta_text and not out.finished and logprobs is None and not token_ids:
            return []
        choice = CompletionChoice(
            index=index,
            text=out.delta_text,
            logprobs=logprobs,
            finish_reason=out.finish_reason if out.finished else None,
            token_ids=token_ids,
        )
        # continuous usage: this choice's (its prompt, its tokens so far), as vLLM reports it
        return [self._chunk([choice], usage_of([out]) if self.continuous else None)]

    def tail(self) -> Iterable[BaseModel]:
        options = self.req.stream_options
        if options is None or not options.include_usage:
            return []
        finals = [o for o in self.last if o is not None]
        return [self._chunk([], usage_of(finals))]
