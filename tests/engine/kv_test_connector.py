"""An in-memory KV connector for tests: raw KV per chunk of tokens, keyed by chained hash.

It copies KV out of the engine's paged cache on ``save_kv`` and scatters it
back on ``start_load_kv``, exactly through the contract a real connector
(kvtier's) uses, so a fresh engine sharing the ``store`` dict skips prefill.
``mode`` injects failures: ``"raise"`` (load raises), ``"partial"`` (loads
half, reports failure, and scribbles garbage over the rest so that anything
not recomputed would corrupt the output), ``"silent"`` (reports nothing),
``"lookup-raises"``. With ``asynchronous`` the loads are asynchronous: each
is placed and reported by the ``hold``-th ``get_finished`` call after it
started (``"silent"`` then reports it as a failure, as a deadline would).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from kvtier.engine.connector import (
    ConnectorRequest,
    KVConnector,
    LoadMetadata,
    LoadOutcome,
    RequestLoadResult,
    SaveMetadata,
)
from kvtier.engine.kv_cache import KVCacheLayout


def chunk_keys(tokens: list[int], chunk: int) -> list[bytes]:
    """Chained xxh3-128 keys of the full chunks of ``tokens``."""
    keys: list[bytes] = []
    prev = b"test-namespace"
    for i in range(len(tokens) // chunk):
        h = xxhash.xxh3_128(prev + np.asarray(tokens[i * chunk : (i + 1) * chunk], "<i4").tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


@dataclass
class Calls:
    """What the engine called, in order (for contract tests)."""

    log: list[tuple[str, str]] = field(default_factory=list)


class InMemoryConnector(KVConnector):
    """See the module docstring."""

    def __init__(
        self,
        config_path: str | None = None,
        store: dict[bytes, torch.Tensor] | None = None,
        chunk: int = 8,
        mode: str = "ok",
        asynchronous: bool = False,
        hold: int = 1,
    ) -> None:
        super().__init__(config_path)
        self.store: dict[bytes, torch.Tensor] = {} if store is None else store
        self.chunk = chunk
        self.mode = mode
        self.calls = Calls()
        self.kv: torch.Tensor | None = None
        self.layout: KVCacheLayout | None = None
        self._outcome = LoadOutcome()
        self.saved_specs: list = []
        self.finished_blocks: dict[str, list[int]] = {}
        self.engine_block_refs: object | None = None  # set by tests to inspect refcounts
        self.asynchronous = asynchronous
        self.hold = hold
        self.pending: dict[str, list] = {}  # request id -> [spec, get_finished calls left]
        self.waits = 0

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int | tuple[int, bool]:
        self.calls.log.append(("match", request.request_id))
        if self.mode == "lookup-raises":
            raise RuntimeError("lookup backend down")
        n = 0
        for key in chunk_keys(request.prompt_token_ids, self.chunk):
            if key not in self.store:
                break
            n += self.chunk
        n = max(0, min(n, len(request.all_token_ids) - 1) - num_computed_tokens)
        return (n, True) if self.asynchronous and n > 0 else n

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        self.calls.log.append(("alloc", request.request_id))

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        self.calls.log.append(("finished", request.request_id))
        self.finished_blocks[request.request_id] = list(block_ids)
        self.pending.pop(request.request_id, None)  # never written after this
        if callable(self.engine_block_refs):
            self.finished_refcounts = self.engine_block_refs(block_ids)

    # worker side
    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        self.kv = kv_cache
        self.layout = layout

    def _slots(self, block_ids: list[int], positions: range) -> torch.Tensor:
        assert self.layout is not None
        bs = self.layout.block_size
        return torch.tensor([block_ids[p // bs] * bs + p % bs for p in positions])

    def _flat(self) -> torch.Tensor:
        assert self.kv is not None and self.layout is not None
        lay = self.layout
        # [L, 2, num_blocks * block_size, kv_heads, head_dim]
        return self.kv.view(lay.num_layers, 2, -1, lay.num_kv_heads, lay.head_dim)

    def start_load_kv(self, metadata: LoadMetadata) -> None:
        self.calls.log.append(("load", ",".join(s.request_id for s in metadata.requests)))
        if self.mode == "raise":
            raise OSError("simulated tier failure")
        results = {}
        for spec in metadata.requests:
            if spec.asynchronous:
                self.pending[spec.request_id] = [spec, self.hold]
                continue
            result = self._place(spec)
            if result is not None:
                results[spec.request_id] = result
        self._outcome = LoadOutcome(results)

    def _place(self, spec) -> RequestLoadResult | None:
        flat = self._flat()
        keys = chunk_keys(spec.token_ids, self.chunk)
        todo = spec.num_tokens if self.mode != "partial" else spec.num_tokens // 2
        end = spec.start + todo
        for pos in range(spec.start, end):
            data = self.store[keys[pos // self.chunk]]  # [L, 2, chunk, H, D]
            slot = self._slots(spec.block_ids, range(pos, pos + 1))
            flat[:, :, slot] = data[:, :, pos % self.chunk : pos % self.chunk + 1]
        if self.mode == "partial":
            rest = self._slots(spec.block_ids, range(end, spec.start + spec.num_tokens))
            flat[:, :, rest] = 1e4  # garbage: must be recomputed by the engine
            return RequestLoadResult(loaded_tokens=todo, failed=True)
        if self.mode == "silent":
            return None
        return RequestLoadResult(loaded_tokens=spec.num_tokens)

    def wait_for_load(self) -> LoadOutcome:
        self.calls.log.append(("wait", ""))
        return self._outcome

    def get_finished(self) -> LoadOutcome:
        self.calls.log.append(("get_finished", ""))
        results = {}
        for rid, entry in list(self.pending.items()):
            entry[1] -= 1
            if entry[1] > 0:
                continue
            del self.pending[rid]
            result = self._place(entry[0])
            results[rid] = result if result is not None else RequestLoadResult(0, failed=True)
        return LoadOutcome(results)

    def wait_for_async_loads(self, timeout_s: float) -> None:
        self.waits += 1

    def save_kv(self, metadata: SaveMetadata) -> None:
        self.calls.log.append(("save", ",".join(s.request_id for s in metadata.requests)))
        flat = self._flat()
        for spec in metadata.requests:
            self.saved_specs.append(spec)
            keys = chunk_keys(spec.token_ids[: spec.num_prompt_tokens], self.chunk)
            for i in range(spec.num_computed_prompt_tokens // self.chunk):
                if keys[i] in self.store:
                    continue
                slots = self._slots(spec.block_ids, range(i * self.chunk, (i + 1) * self.chunk))
                self.store[keys[i]] = flat[:, :, slots].clone()
