"""``POST /v1/chat/completions``: a reply to a conversation, rendered with the model's chat template."""

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
from kvtier.engine.server.inputs import chat_inputs, check_model
from kvtier.engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    Usage,
)
from kvtier.engine.server.responses import chat_logprobs, usage_of
from kvtier.engine.server.state import ServerState
from kvtier.engine.server.streaming import collect_unless_disconnected, start_stream


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    """Answers one chat request (JSON or, with ``stream``, server-sent events)."""
    release = state.acquire()
    try:
        req = parse_body(
            await read_body(request, state.limits.max_body_bytes), ChatCompletionRequest
        )
        check_model(req.model, state.served_names)
        engine = state.engine
        # NOTE: tokenizing (and rendering a template) can take a while for a
        # long prompt; a worker thread keeps the event loop streaming meanwhile.
        inputs = await run_in_threadpool(chat_inputs, req, engine.tokenizer, engine.max_model_len)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        generation = Generation(engine, rid, inputs.prompts, inputs.params)
        if req.stream:
            stream = _ChatStream(state, req, rid, created)
            response = await start_stream(generation, stream.render, stream.tail, release)
            release = _noop  # the response releases the slot when it ends
            return response
        finals = await collect_unless_disconnected(request, generation)
        out = finals[0]
        logprobs = None
        if req.logprobs and out.logprobs is not None:
            logprobs = chat_logprobs(engine.tokenizer, out.logprobs)
        body = ChatCompletionResponse(
            id=rid,
            created=created,
            model=req.model or state.served_model_name,
            choices=[
                ChatChoice(
                    index=0,
                    message=AssistantMessage(content=out.text),
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    token_ids=list(out.token_ids) if req.return_token_ids else None,
                )
            ],
            usage=usage_of(finals),
        )
        return JSONResponse(body.model_dump())
    finally:
        release()


def _noop() -> None:
    return None


class _ChatStream:
    """Turns engine outputs into ``chat.completion.chunk`` events.

    The first chunk carries ``delta.role = "assistant"``; the last carries
    ``finish_reason``; with ``stream_options.include_usage`` a final chunk
    with no choices carries ``usage``; with ``continuous_usage_stats`` every
    chunk carries the usage so far.
    """

    def __init__(
        self, state: ServerState, req: ChatCompletionRequest, rid: str, created: int
    ) -> None:
        self.state = state
        self.req = req
        self.rid = rid
        self.created = created
        self.model = req.model or state.served_model_name
        self.sent_role = False
        self.sent_logprobs = 0
        self.last: RequestOutput | None = None
        self.continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def _chunk(
        self, choices: list[ChatChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def render(self, index: int, out: RequestOutput) -> Iterable[BaseModel]:
        self.last = out
        usage = usage_of([out]) if self.continuous else None
        events: list[BaseModel] = []
        if not self.sent_role:
            self.sent_role = True
            events.append(
                self._chunk(
                    [ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
                    usage,
                )
            )
        logprobs: ChatLogprobs | None = None
        if self.req.logprobs and out.logprobs is not None:
            new = out.logprobs[self.sent_logprobs :]
            self.sent_logprobs = len(out.logprobs)
            if new:
                logprobs = chat_logprobs(self.state.engine.tokenizer, new)
        token_ids = list(out.delta_token_ids) if self.req.return_token_ids else None
        if out.delta_text or out.finished or logprobs is not None or token_ids:
            events.append(
                self._chunk(
                    [
                        ChatChunkChoice(
                            index=0,
                            delta=DeltaMessage(content=out.delta_text),
                            logprobs=logprobs,
                            finish_reason=out.finish_reason if out.finished else None,
                            token_ids=token_ids,
                        )
                    ],
                    usage,
                )
            )
        return events

    def tail(self) -> Iterable[BaseModel]:
        options = self.req.stream_options
        if options is None or not options.include_usage or self.last is None:
            return []
        return [self._chunk([], usage_of([self.last]))]
