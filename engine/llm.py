"""``LLM``: the offline, synchronous convenience API over ``LLMEngine``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvtier.engine.config import EngineConfig
from kvtier.engine.connector import KVConnector
from kvtier.engine.errors import InvalidRequestError
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.sampling_params import SamplingParams

Prompt = str | list[int]


def _normalize_prompts(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, bytes | bytearray):
        items = list(prompts)
        if not items:
            return []
        if all(isinstance(p, int) and not isinstance(p, bool) for p in items):
            return [items]  # one prompt of token ids
        out: list[Prompt] = []
        for p in items:
            if isinstance(p, str):
                out.append(p)
            elif isinstance(p, Sequence) and not isinstance(p, bytes | bytearray):
                out.append(list(p))
            else:
                raise InvalidRequestError(
                    "prompts must be a string, a list of strings, a list of token ids "
                    "or a list of token-id lists",
                    "prompt",
                )
        return out
    raise InvalidRequestError("prompts must be a string or a list", "prompt")


def _normalize_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise InvalidRequestError(f"got {len(plist)} SamplingParams for {n} prompts", "params")
    return plist


class LLM:
    """Generate text from a model in-process.

    Args:
        model: Path to a ``.gguf`` file or a Hugging Face-style directory.
        metrics: Optional Prometheus metrics.
        connector: Optional KV connector instance.
        **overrides: Any other ``EngineConfig`` field.
    """

    def __init__(
        self,
        model: str,
        *,
        metrics: EngineMetrics | None = None,
        connector: KVConnector | None = None,
        **overrides: Any,
    ) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **overrides), metrics, connector)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates for every prompt (batched); returns final outputs in prompt order.

        Raises:
            InvalidRequestError: for a bad prompt or parameters (nothing runs then).
        """
        plist = _normalize_prompts(prompts)
        params_list = _normalize_params(params, len(plist))
        engine = self.engine
        prepared = [engine.prepare(p, sp) for p, sp in zip(plist, params_list, strict=True)]
        ids = [engine.add_prepared(p) for p in prepared]
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate")
        try:
            pending = set(ids)
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:
                if rid not in final:
                    engine.abort(rid)
        return [final[rid] for rid in ids]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields the request's output after every step that changed it.

        Closing the iterator early aborts the request.
        """
        engine = self.engine
        rid = engine.add_request(prompt if isinstance(prompt, str) else list(prompt), params)
        done = False
        try:
            while not done:
                for out in engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                engine.abort(rid)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Renders one conversation (or a list of them) with the chat template and generates.

        Raises:
            InvalidRequestError: for malformed messages or a model without a template.
        """
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", "messages")
        conversations = messages if isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        prompts: list[list[int]] = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=True, **template_kwargs)
            # NOTE: the template already places any BOS text; do not add another.
            prompts.append(tok.encode(text, add_special_tokens=False))
        return self.generate(prompts, params, use_tqdm=use_tqdm)
