"""``LLMEngine``: requests in, one ``step()`` at a time, ``RequestOutput``s out."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.engine.attention import TorchPagedAttention
from kvtier.engine.block_manager import BlockManager
from kvtier.engine.config import DEFAULT_MAX_MODEL_LEN_CAP, EngineConfig
from kvtier.engine.connector import (
    KVConnector,
    LoadOutcome,
    NullConnector,
    RequestLoadResult,
    SaveMetadata,
    SaveSpec,
    keys_namespace,
    make_connector,
)
from kvtier.engine.cpu_kernels import cpu_kernels
from kvtier.engine.detokenizer import IncrementalDetokenizer
from kvtier.engine.device import dtype_name, resolve_device, resolve_dtype
from kvtier.engine.errors import EngineConfigError, EngineError, InvalidRequestError
from kvtier.engine.kv_cache import (
    KVCacheLayout,
    KVCapacity,
    allocate_kv_cache,
    num_blocks_for_budget,
)
from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.models.config import ModelConfig
from kvtier.engine.models.fused import fused_supported
from kvtier.engine.models.loader import load_model
from kvtier.engine.models.packed import pack_linears, packing_supported
from kvtier.engine.models.rope import RotaryEmbedding
from kvtier.engine.outputs import EngineStats, FinishReason, RequestOutput, TokenLogprob
from kvtier.engine.prompt import PreparedPrompt, prepare_prompt
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.sampler import SampleResult
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from kvtier.engine.step_trace import StepTrace
from kvtier.engine.threads import ThreadPolicy
from kvtier.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Longest an engine with nothing to compute but loads in flight waits for one
# of them before it returns from step() (new requests are picked up between steps).
ASYNC_LOAD_POLL_S = 0.005
# The shortest start-up (model load) over which "auto" threads decide before the first step.
STARTUP_THREADS_WINDOW_S = 0.2


@dataclass(frozen=True)
class ScoreResult:
    """Logits of ``token_ids[start:]`` (``[n - start, vocab]`` float32)."""

    start: int
    logits: torch.Tensor


class LLMEngine:
    """A paged-attention engine for one model.

    Not thread-safe: one thread drives ``add_request``/``step``/``abort``
    (``AsyncLLMEngine`` wraps it for concurrent callers).

    Args:
        config: The engine configuration.
        metrics: Optional Prometheus metrics to update every step.
        connector: A KV connector instance; default built from
            ``config.kv_connector`` (``NullConnector`` when unset).

    Raises:
        ModelLoadError, EngineConfigError, ConnectorError: at start-up.
    """

    def __init__(
        self,
        config: EngineConfig,
        metrics: EngineMetrics | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # On CPU the torch thread count follows config.num_threads ("auto": the cores other
        # processes leave free, re-decided during steps; engine/threads.py).
        self.threads = ThreadPolicy(config.num_threads)
        if self.device.type == "cpu":
            self.threads.start()

        loaded = load_model(config.model, self.dtype, self.device)
        cfg = loaded.config
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            assert isinstance(config.kv_cache_memory, int)
            num_blocks = num_blocks_for_budget(
                cfg, config.block_size, self.dtype, config.kv_cache_memory
            )
        self._max_model_len = self._resolve_max_model_len(cfg, num_blocks * config.block_size)
        if loaded.model.rotary.max_positions != self._max_model_len:
            loaded.model.rotary = RotaryEmbedding(cfg, self._max_model_len, self.dtype).to(
                self.device
            )
        kernels = cpu_kernels() if self.device.type == "cpu" else None
        if packing_supported(self.device, self.dtype):
            pack_linears(loaded.model)  # faster GEMV, identical outputs (models/packed.py)
        if kernels is not None and fused_supported(loaded.model, self.device, self.dtype):
            loaded.model.fused_kernels = kernels  # fewer, fused element-wise ops (models/fused.py)
        self._model = loaded.model
        self._model_config = cfg
        self._tokenizer = loaded.tokenizer
        self._model_id = loaded.model_id
        self._fingerprint = loaded.fingerprint
        self._eos_ids = frozenset(cfg.eos_token_ids)

        self.layout = KVCacheLayout(
            model_id=self._model_id,
            fingerprint=self._fingerprint,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype_name(self.dtype),
            block_size=config.block_size,
            num_blocks=num_blocks,
            device=str(self.device),
        )
        self.kv_cache = allocate_kv_cache(self.layout, self.dtype)
        self.connector = connector or make_connector(
            config.kv_connector, config.kv_connector_config
        )
        self.connector.register_kv_caches(self.kv_cache, self.layout)
        self._saves_wanted = not isinstance(self.connector, NullConnector)

        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            keys_namespace(self.connector, self.layout),  # one hash per request
        )
        self.scheduler = Scheduler(
            self.block_manager, self.connector, config.max_num_seqs, config.max_num_batched_tokens
        )
        backend = TorchPagedAttention(self.kv_cache, cfg.num_heads, kernels)
        self.runner = ModelRunner(self._model, backend, config.block_size, self.device)
        self._num_requests = 0
        self._stats = EngineStats(kv_blocks_total=num_blocks)
        if self.metrics is not None:  # the KV capacity from the start, not from the first step:
            self.metrics.update(self._stats)  # a router sizes a fresh engine's warm-up by it
        self._trace = StepTrace.from_env()
        self.threads.tick(min_window_s=STARTUP_THREADS_WINDOW_S)  # decided over the start-up

    def _resolve_max_model_len(self, cfg: ModelConfig, kv_capacity: int) -> int:
        requested = self.config.max_model_len
        if requested is None:
            return max(2, min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP, kv_capacity))
        if requested > cfg.max_position_embeddings:
            raise EngineConfigError(
                f"max_model_len {requested} exceeds the model's context "
                f"({cfg.max_position_embeddings})"
            )
        if requested > kv_capacity:
            raise EngineConfigError(
                f"max_model_len {requested} exceeds the KV cache capacity of {kv_capacity} tokens; "
                "raise kv_cache_memory or num_kv_blocks"
            )
        return requested

    # ---- properties ---------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (``encode``, ``decode``, ``apply_chat_template``)."""
        return self._tokenizer

    @property
    def model_config(self) -> ModelConfig:
        """The model's hyper-parameters."""
        return self._model_config

    @property
    def model_id(self) -> str:
        """Readable model name."""
        return self._model_id

    @property
    def fingerprint(self) -> str:
        """Hex digest of the model's weights."""
        return self._fingerprint

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + generated) the engine accepts."""
        return self._max_model_len

    @property
    def capacity(self) -> KVCapacity:
        """What the KV cache holds, in tokens and concurrent requests."""
        return KVCapacity(
            tokens=self.layout.num_blocks * self.layout.block_size,
            nbytes=self.kv_cache.numel() * self.kv_cache.element_size(),
            dtype=self.layout.dtype,
            max_model_len=self._max_model_len,
            max_num_seqs=self.config.max_num_seqs,
        )

    # ---- requests ---------------------------------------------------------------------

    def prepare(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> PreparedPrompt:
        """Validates and tokenizes a request without queueing it (thread-safe).

        Raises:
            InvalidRequestError: for a bad prompt, bad parameters or a request
                that cannot fit in ``max_model_len``.
        """
        return prepare_prompt(
            self._tokenizer,
            self._model_config.vocab_size,
            self._max_model_len,
            prompt,
            params,
            request_id,
        )

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queues a request; returns its id.

        Raises:
            InvalidRequestError: see ``prepare``; also for a duplicate id.
        """
        return self.add_prepared(self.prepare(prompt, params, request_id))

    def add_prepared(self, prepared: PreparedPrompt, arrival_time: float | None = None) -> str:
        """Queues a request made by ``prepare``.

        Raises:
            InvalidRequestError: if a request with the same id is unfinished.
        """
        if self.scheduler.find(prepared.request_id) is not None:
            raise InvalidRequestError(
                f"request id {prepared.request_id!r} is already in use", "request_id"
            )
        params = prepared.params
        generator: torch.Generator | None = None
        if not params.greedy:
            # NOTE: unseeded requests still get their own stream, derived from
            # the engine seed and arrival order, so a run is reproducible.
            seed = params.seed
            if seed is None:
                seed = (self.config.seed * 1_000_003 + self._num_requests) % (2**63)
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        self._num_requests += 1
        req = Request(
            prepared.request_id,
            prepared.prompt_token_ids,
            params,
            generator,
            IncrementalDetokenizer(self._tokenizer, prepared.prompt_token_ids),
            arrival_time,
        )
        self.scheduler.add(req)
        return req.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request wherever it is and frees its blocks.

        Returns:
            Its final output (``finish_reason == "abort"``), or None if no
            unfinished request has this id. The output is not repeated by ``step()``.
        """
        req = self.scheduler.find(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        self._stats.num_aborted += 1
        out = self._make_output(req)
        self._update_metrics()
        return out

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step and forward pass.

        Returns:
            Outputs of requests that produced a token or finished in this step.
        """
        if not self.scheduler.has_unfinished():
            return []
        self.threads.tick()
        t0 = time.perf_counter()
        if self.scheduler.loading:
            self._collect_async_loads()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        self._load_external(sched)
        if not sched.chunks:
            waiting_on_io = self.scheduler.loading or sched.lookups_pending
            if not waiting_on_io and not sched.async_loads:
                raise EngineError("scheduler planned an empty step with requests pending")
            if waiting_on_io:
                self._wait_for_async_loads()  # only fetches or lookups in flight: wait, do not spin
            self._update_metrics()
            return []
        t2 = time.perf_counter()
        sampled = self.runner.execute(sched.chunks)
        t3 = time.perf_counter()
        if self._trace is not None:
            self._trace.record(t2, t3 - t2, sched.chunks)
        self.scheduler.update_after_step(sched)
        self._count_prompt_tokens(sched)
        if self._saves_wanted:
            self._save_external(sched)
        outputs = []
        now = time.monotonic()
        for chunk, result in sampled:
            req = chunk.request
            self._append_token(req, result, now)
            outputs.append(self._make_output(req))
        self._stats.num_steps += 1
        self._update_metrics()
        if self.metrics is not None:
            decodes = sum(1 for c in sched.chunks if c.num_tokens == 1)
            phases = {
                "schedule": t1 - t0,
                "load": t2 - t1,
                "forward": t3 - t2,
                "finish": time.perf_counter() - t3,
            }
            self.metrics.observe_step(phases, sched.num_batched_tokens - decodes, decodes)
        return outputs

    def _load_external(self, sched: SchedulerOutput) -> None:
        meta = self.scheduler.load_metadata(sched)
        if meta is None:
            return
        try:
            self.connector.start_load_kv(meta)
        except Exception:  # a cache failure is never a request failure
            logger.exception("kv connector start_load_kv failed; recomputing")
            self.scheduler.counters.connector_errors += 1
            failed = {s.request_id: RequestLoadResult(0, failed=True) for s in sched.async_loads}
            self.scheduler.apply_async_outcome(LoadOutcome(failed))
            self.scheduler.apply_load_outcome(sched, None)
            return
        if not any(c.num_external for c in sched.chunks):
            return  # only asynchronous loads: get_finished reports them in later steps
        try:
            outcome = self.connector.wait_for_load()
        except Exception:  # a cache failure is never a request failure
            logger.exception("kv connector load failed; recomputing")
            outcome = None
        self.scheduler.apply_load_outcome(sched, outcome)

    def _collect_async_loads(self) -> None:
        try:
            outcome = self.connector.get_finished()
        except Exception:  # the loads stay pending; the connector's deadline ends them
            logger.exception("kv connector get_finished failed")
            self.scheduler.counters.connector_errors += 1
            return
        self.scheduler.apply_async_outcome(outcome)

    def _wait_for_async_loads(self) -> None:
        try:
            self.connector.wait_for_async_loads(ASYNC_LOAD_POLL_S)
        except Exception:
            logger.exception("kv connector wait_for_async_loads failed")
            self.scheduler.counters.connector_errors += 1
            time.sleep(ASYNC_LOAD_POLL_S)

    def _count_prompt_tokens(self, sched: SchedulerOutput) -> None:
        for c in sched.chunks:
            n = min(c.compute_start + c.num_tokens, c.request.num_prompt_tokens) - c.compute_start
            if n > 0:
                self._stats.prompt_tokens_computed += n

    def _save_external(self, sched: SchedulerOutput) -> None:
        bs = self.config.block_size
        specs = []
        for c in sched.chunks:
            req = c.request
            in_prefill = c.compute_start < req.num_prompt_tokens
            if not in_prefill and req.num_computed_tokens % bs:
                continue  # a decode step that did not complete a block
            specs.append(
                SaveSpec(
                    request_id=req.request_id,
                    token_ids=req.token_ids,
                    block_ids=req.block_ids,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_computed_tokens=req.num_computed_tokens,
                    num_computed_prompt_tokens=min(req.num_computed_tokens, req.num_prompt_tokens),
                    phase="prefill" if in_prefill else "decode",
                    prefill_done=req.num_computed_tokens >= req.num_prompt_tokens,
                )
            )
        if not specs:
            return
        try:
            self.connector.save_kv(SaveMetadata(specs))
        except Exception:  # a failed save is a future miss, never a request failure
            logger.exception("kv connector save failed")
            self.scheduler.counters.connector_errors += 1

    def _append_token(self, req: Request, result: SampleResult, now: float) -> None:
        token = result.token_id
        params = req.params
        req.token_ids.append(token)
        self._stats.generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            if self.metrics is not None:
                self.metrics.observe_ttft(now - req.arrival_time)
        elif self.metrics is not None and req.last_token_time is not None:
            self.metrics.observe_itl(now - req.last_token_time)
        req.last_token_time = now
        if req.logprobs is not None and result.logprob is not None:
            req.logprobs.append(
                TokenLogprob(
                    token_id=token,
                    token=self._tokenizer.decode([token], skip_special_tokens=False),
                    token_bytes=self._tokenizer.token_bytes(token),
                    logprob=result.logprob,
                    top_logprobs=result.top_logprobs or [],
                )
            )
        reason: FinishReason | None = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self._eos_ids):
            reason = "stop"
            req.stop_reason = token
            # the stop token is not rendered; bytes still pending before it are
            prev = len(req.text)
            req.text += req.detokenizer.flush()
            hit = req.stop_matcher.find(req.text, prev)
            if hit is not None:
                req.text = req.text[: hit[0]]
                req.stop_reason = hit[1]
        else:
            prev = len(req.text)
            req.text += req.detokenizer.add(token)
            at_limit = (
                req.num_output_tokens >= params.max_tokens or req.num_tokens >= self._max_model_len
            )
            if at_limit:
                req.text += req.detokenizer.flush()
            hit = req.stop_matcher.find(req.text, prev)
            if hit is not None:
                req.text = req.text[: hit[0]]
                reason = "stop"
                req.stop_reason = hit[1]
            elif at_limit:
                reason = "length"
        if reason is not None:
            self.scheduler.finish(req, reason)
            self._stats.num_finished += 1

    def _make_output(self, req: Request) -> RequestOutput:
        finished = req.status == RequestStatus.FINISHED
        end = len(req.text) if finished else req.stop_matcher.streamable(len(req.text))
        start = min(req.num_emitted_chars, end)
        delta_text = req.text[start:end]
        req.num_emitted_chars = max(req.num_emitted_chars, end)
        outputs = req.output_token_ids
        delta_ids = outputs[req.num_emitted_tokens :]
        req.num_emitted_tokens = len(outputs)
        logprobs = None
        if req.logprobs is not None:
            logprobs = list(req.logprobs)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(outputs),
            text=req.text if finished else req.text[:end],
            delta_token_ids=delta_ids,
            delta_text=delta_text,
            finished=finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            num_external_tokens=req.num_external_tokens,
            ttft_s=(
                req.first_token_time - req.arrival_time
                if req.first_token_time is not None
                else None
            ),
            logprobs=logprobs,
            stop_reason=req.stop_reason,
        )

    # ---- scoring -------------------------------------------------------------------------

    def score(self, token_ids: Sequence[int], use_prefix_cache: bool = True) -> ScoreResult:
        """Logits at every position of ``token_ids`` through the paged path.

        The sequence is prefilled in chunks of ``max_num_batched_tokens``
        after any prefix-cache hit; its full blocks are cached afterwards like
        a request's. Used for perplexity-style scoring and by the tests.

        Returns:
            ``ScoreResult``: logits ``[n - start, vocab]`` float32 for positions
            ``start .. n-1`` (``start`` = tokens served by the prefix cache).

        Raises:
            EngineError: if requests are in flight (scoring needs an idle engine).
            InvalidRequestError: for bad token ids or a sequence that cannot fit.
        """
        if self.has_unfinished():
            raise EngineError("score() needs an idle engine")
        ids = self.prepare(list(token_ids), SamplingParams(temperature=0.0, max_tokens=1))
        req = Request(
            "score-" + uuid.uuid4().hex,
            ids.prompt_token_ids,
            ids.params,
            None,
            IncrementalDetokenizer(self._tokenizer, []),
        )
        bm = self.block_manager
        hits = bm.find_cached_prefix(req) if use_prefix_cache else []
        start = len(hits) * bm.block_size
        if not bm.can_allocate(hits, req.num_tokens):
            raise InvalidRequestError("sequence does not fit in the free KV blocks", "prompt")
        bm.allocate(req, hits, req.num_tokens)
        req.num_computed_tokens = start
        parts = []
        try:
            pos = start
            while pos < req.num_tokens:
                n = min(self.config.max_num_batched_tokens, req.num_tokens - pos)
                parts.append(self.runner.prompt_logits([ScheduledChunk(req, pos, 0, n)]))
                pos += n
                req.num_computed_tokens = pos
                bm.cache_blocks(req)
        finally:
            bm.free(req)
        return ScoreResult(start=start, logits=torch.cat(parts))

    # ---- statistics -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of counters and gauges."""
        s = self._stats
        bm = self.block_manager
        c = self.scheduler.counters
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_loading=len(self.scheduler.loading),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached_free=bm.num_cached_free_blocks,
            prefix_cache_queries_tokens=bm.prefix_cache_queries_tokens,
            prefix_cache_hit_tokens=bm.prefix_cache_hit_tokens,
            external_query_tokens=c.external_query_tokens,
            external_matched_tokens=c.external_matched_tokens,
            external_loaded_tokens=c.external_loaded_tokens,
            load_failures=c.load_failures,
            recomputed_after_load_failure_tokens=c.recomputed_after_load_failure_tokens,
            connector_errors=c.connector_errors,
            prompt_tokens_computed=s.prompt_tokens_computed,
            generation_tokens=s.generation_tokens,
            num_preemptions=c.num_preemptions,
            num_steps=s.num_steps,
            num_finished=s.num_finished,
            num_aborted=s.num_aborted,
        )

    def _update_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.update(self.stats())

    def shutdown(self) -> None:
        """Shuts the connector down (the engine is unusable afterwards)."""
        if self._trace is not None:
            self._trace.close()
        self.connector.shutdown()
