"""Turns a step's scheduled chunks into tensors, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.engine.attention import (
    DEFAULT_PREFILL_TILE,
    AttentionBackend,
    AttentionMetadata,
    PrefillSpan,
    build_prefill_tiles,
)
from kvtier.engine.models.llama import DecoderModel
from kvtier.engine.sampler import SampleResult, sample
from kvtier.engine.scheduler import ScheduledChunk


@dataclass
class StepBatch:
    """The tensors of one forward pass.

    Attributes:
        input_ids: ``[T]`` token ids.
        positions: ``[T]`` positions.
        meta: Attention metadata.
        sample_rows: Row of each sampling chunk's last token, in ``sample_chunks`` order.
        sample_chunks: The chunks that sample a token this step.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]
    sample_chunks: list[ScheduledChunk]


class ModelRunner:
    """Runs the model over the paged KV cache.

    Args:
        model: The decoder.
        backend: Attention over the cache.
        block_size: Tokens per KV block.
        device: Where tensors live.
        prefill_tile: Query tile for prefills after a cached prefix.
    """

    def __init__(
        self,
        model: DecoderModel,
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
        prefill_tile: int = DEFAULT_PREFILL_TILE,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.prefill_tile = prefill_tile

    def build_batch(self, chunks: list[ScheduledChunk]) -> StepBatch:
        """Lays out chunks decode-first and builds slot mappings, block tables and masks."""
        bs = self.block_size
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        ids: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        row = 0
        for c in decodes + prefills:
            req = c.request
            start, n = c.compute_start, c.num_tokens
            p = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(req.block_ids, dtype=np.int64)
            ids.append(np.asarray(req.token_ids[start : start + n], dtype=np.int64))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            row += n
            if c.samples:
                sample_rows.append(row - 1)
                sample_chunks.append(c)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            num_decode_tokens=len(decodes),
        )
        if decodes:
            ctx = [c.compute_start + 1 for c in decodes]
            nb = -(-max(ctx) // bs)
            table = np.zeros((len(decodes), nb), dtype=np.int64)
            for i, c in enumerate(decodes):
                used = -(-ctx[i] // bs)
                table[i, :used] = c.request.block_ids[:used]
            meta.decode_block_table = torch.from_numpy(table).to(dev)
            lens = torch.tensor(ctx, device=dev)
            meta.decode_lens = lens if dev.type == "cpu" else None
            meta.decode_mask = (torch.arange(nb * bs, device=dev)[None, :] < lens[:, None]).view(
                len(decodes), 1, 1, nb * bs
            )
        q_start = len(decodes)
        in_place = getattr(self.backend, "prefill_in_place", False)
        for c in prefills:
            span = PrefillSpan(q_start=q_start, q_len=c.num_tokens, prefix_len=c.compute_start)
            if c.compute_start > 0 or in_place:
                used = -(-(c.compute_start + c.num_tokens) // bs)
                span.block_ids = torch.tensor(c.request.block_ids[:used], device=dev)
            if c.compute_start > 0 and not in_place:
                span.tiles = build_prefill_tiles(
                    c.compute_start, c.num_tokens, self.prefill_tile, dev
                )
            meta.prefills.append(span)
            q_start += c.num_tokens
        return StepBatch(
            input_ids=torch.from_numpy(np.concatenate(ids)).to(dev),
            positions=torch.from_numpy(np.concatenate(pos)).to(dev),
            meta=meta,
            sample_rows=sample_rows,
            sample_chunks=sample_chunks,
        )

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[tuple[ScheduledChunk, SampleResult]]:
        """Runs one forward pass; returns the sampled token of every chunk that samples."""
        batch = self.build_batch(chunks)
        hidden = self.model(batch.input_ids, batch.positions, self.backend, batch.meta)
        if not batch.sample_rows:
            return []
        rows = torch.tensor(batch.sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        reqs = [c.request for c in batch.sample_chunks]
        results = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        return list(zip(batch.sample_chunks, results, strict=True))

    @torch.inference_mode()
    def prompt_logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Runs one forward pass and returns float32 logits of every computed token (tests)."""
        batch = self.build_batch(chunks)
        hidden = self.model(batch.input_ids, batch.positions, self.backend, batch.meta)
        return self.model.compute_logits(hidden)
