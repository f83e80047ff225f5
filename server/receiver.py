"""Reassembly of a Put stream's blocks: frames in, whole verified blocks into the store.

A block's declared size is reserved from the shared :class:`ByteBudget` when
its first frame arrives and released when it is stored or dropped, so the
memory held by half-received blocks is bounded across all streams. A block
reaches the store only once all its bytes have come and
:func:`~kvtier.block.verify_block` passed; whatever ends the stream early
(its end, a refusal, a cancelled or dead client) drops the unfinished block.
"""

from __future__ import annotations

from kvtier.block import verify_block
from kvtier.errors import CorruptBlockError
from kvtier.server.admission import KEY_SIZE, ByteBudget, invalid, over_limit
from kvtier.server.config import ServerConfig
from kvtier.server.metrics import ServerMetrics
from kvtier.server.proto.frames import PutFrameView
from kvtier.server.tenants import Tenant
from kvtier.store import TieredStore


class BlockReceiver:
    """Reassembles the blocks of one Put stream; a block reaches the store only when complete and valid.

    Args:
        tenant: Whose keys the blocks go under.
        store: Where complete blocks go.
        budget: Bytes of half-received blocks, shared by every stream.
        config: Limits.
        metrics: Bytes in, incomplete blocks.
    """

    def __init__(
        self,
        tenant: Tenant,
        store: TieredStore,
        budget: ByteBudget,
        config: ServerConfig,
        metrics: ServerMetrics,
    ) -> None:
        self._tenant = tenant
        self._store = store
        self._budget = budget
        self._config = config
        self._metrics = metrics
        self.blocks = 0
        self.bytes = 0
        self._key: bytes | None = None
        self._size = 0
        self._received = 0
        self._parts: list[memoryview] = []
        self._reserved = 0

    def feed(self, frame: PutFrameView) -> None:
        """Take one frame.

        Raises:
            RequestError: the frame breaks the stream's order or exceeds a
                limit; the stream is refused.
        """
        cfg = self._config
        if len(frame.key):
            if self._key is not None:
                raise invalid(
                    f"block #{self.blocks} ended after {self._received} of its "
                    f"{self._size} declared bytes (a new key arrived)"
                )
            if len(frame.key) != KEY_SIZE:
                raise invalid(
                    f"block #{self.blocks}: key is {len(frame.key)} bytes; keys are exactly {KEY_SIZE}"
                )
            if frame.size == 0:
                raise invalid(f"block #{self.blocks}: size must be set on its first frame")
            if frame.size > cfg.max_block_size:
                raise over_limit(
                    f"block #{self.blocks} declares {frame.size} bytes; "
                    f"this server takes blocks of at most {cfg.max_block_size}"
                )
            if self.blocks >= cfg.max_keys_per_call:
                raise over_limit(
                    f"more than {cfg.max_keys_per_call} blocks in one Put stream; split it"
                )
            if not self._budget.try_reserve(frame.size):
                raise over_limit(
                    f"the server is receiving too many bytes at once (limit "
                    f"{cfg.max_inflight_put_bytes}); retry later"
                )
            self._reserved = frame.size
            self._key = bytes(frame.key)
            self._size = frame.size
            self._received = 0
            self._parts = []
        elif frame.size:
            raise invalid("a PutFrame has a size but no key (size goes on a block's first frame)")
        if len(frame.data):
            if self._key is None:
                raise invalid(
                    "PutFrame data before any block was started (the first frame needs a key)"
                )
            if self._received + len(frame.data) > self._size:
                raise invalid(
                    f"block #{self.blocks} declared {self._size} bytes but more data arrived"
                )
            self._parts.append(frame.data)
            self._received += len(frame.data)
        if self._key is not None and self._received == self._size:
            self._complete()

    def _complete(self) -> None:
        assert self._key is not None
        block = b"".join(self._parts)
        self._parts = []
        try:
            verify_block(block)
        except CorruptBlockError as e:
            raise invalid(f"block #{self.blocks} is not a valid kvtier block: {e}") from None
        (scoped,) = self._tenant.scope([self._key])
        self._store.put([(scoped, block)])
        self.blocks += 1
        self.bytes += len(block)
        self._metrics.bytes.labels(self._tenant.label, "in").inc(len(block))
        self._key = None
        self._release()

    def finish(self) -> None:
        """The stream ended.

        Raises:
            RequestError: it ended inside a block (that block is discarded).
        """
        if self._key is not None:
            raise invalid(
                f"the stream ended inside block #{self.blocks}: "
                f"{self._received} of {self._size} bytes came; it was not stored"
            )

    def abandon(self) -> None:
        """Drop an unfinished block (stream ended, broke or was refused) and its reservation."""
        if self._key is not None:
            self._metrics.incomplete_puts.inc()
            self._key = None
            self._parts = []
        self._release()

    def _release(self) -> None:
        if self._reserved:
            self._budget.release(self._reserved)
            self._reserved = 0
