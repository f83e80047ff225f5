"""Reassembly of a Put stream's blocks: frames in, whole verified blocks into the store.

Used by both planes: a gRPC Put stream feeds it frames (:meth:`BlockReceiver.feed`),
a data-plane PUT a block's header (:meth:`BlockReceiver.begin`) then its
bytes in one piece (:meth:`BlockReceiver.add`), which reach the store without
a copy.

A block's declared size is reserved from the tenant's :class:`ByteBudget` and
from the shared one when its first frame arrives, and released when it is
stored or dropped, so the memory held by half-received blocks is bounded
across all streams, and one tenant cannot take the whole of it. A block
reaches the store only once all its bytes have come and
:func:`~kvtier.block.verify_block` passed (the block carries the key it is put
under); it is stored stamped with its writer (:mod:`kvtier.server.access`).
Whatever ends the stream early (its end, a refusal, a cancelled, stalled or
dead client) drops the unfinished block.
"""

from __future__ import annotations

from kvtier.block import verify_block
from kvtier.errors import CorruptBlockError
from kvtier.server.access import BlockAccess
from kvtier.server.admission import KEY_SIZE, ByteBudget, invalid, over_limit
from kvtier.server.metrics import ServerMetrics
from kvtier.server.tenants import Tenant
from kvtier.server_config import ServerConfig
from kvtier.wire.frames import Buffer, PutFrameView


class BlockReceiver:
    """Reassembles the blocks of one Put stream; a block reaches the store only when complete and valid.

    Args:
        tenant: Who writes the blocks.
        access: Where complete blocks go (stamped, in the tenant's slot).
        budget: Bytes of half-received blocks, shared by every stream.
        tenant_budget: The same, of this tenant's streams only.
        config: Limits.
        metrics: Bytes in, incomplete blocks.
    """

    def __init__(
        self,
        tenant: Tenant,
        access: BlockAccess,
        budget: ByteBudget,
        tenant_budget: ByteBudget,
        config: ServerConfig,
        metrics: ServerMetrics,
    ) -> None:
        self._tenant = tenant
        self._access = access
        self._budget = budget
        self._tenant_budget = tenant_budget
        self._config = config
        self._metrics = metrics
        self.blocks = 0
        self.bytes = 0
        self._key: bytes | None = None
        self._size = 0
        self._received = 0
        self._parts: list[Buffer] = []
        self._reserved = 0

    def feed(self, frame: PutFrameView) -> None:
        """Take one frame.

        Raises:
            RequestError: the frame breaks the stream's order or exceeds a
                limit; the stream is refused.
        """
        if len(frame.key):
            self.begin(frame.key, frame.size)
        elif frame.size:
            raise invalid("a PutFrame has a size but no key (size goes on a block's first frame)")
        if len(frame.data):
            self.add(frame.data)

    def begin(self, key: Buffer, size: int) -> None:
        """Start a block of ``size`` bytes under ``key``: check limits, reserve its bytes.

        Raises:
            RequestError: the previous block is unfinished, the key or size is
                invalid, or a limit (block size, blocks per stream, bytes in
                flight) is reached.
        """
        cfg = self._config
        if self._key is not None:
            raise invalid(
                f"block #{self.blocks} ended after {self._received} of its "
                f"{self._size} declared bytes (a new key arrived)"
            )
        if len(key) != KEY_SIZE:
            raise invalid(
                f"block #{self.blocks}: key is {len(key)} bytes; keys are exactly {KEY_SIZE}"
            )
        if size == 0:
            raise invalid(f"block #{self.blocks}: size must be set on its first frame")
        if size > cfg.max_block_size:
            raise over_limit(
                f"block #{self.blocks} declares {size} bytes; "
                f"this server takes blocks of at most {cfg.max_block_size}"
            )
        if self.blocks >= cfg.max_keys_per_call:
            raise over_limit(
                f"more than {cfg.max_keys_per_call} blocks in one Put stream; split it"
            )
        if not self._tenant_budget.try_reserve(size):
            raise over_limit(
                f"tenant {self._tenant.name!r} is sending too many bytes at once (limit "
                f"{self._tenant_budget.capacity}); retry later"
            )
        if not self._budget.try_reserve(size):
            self._tenant_budget.release(size)
            raise over_limit(
                f"the server is receiving too many bytes at once (limit "
                f"{cfg.max_inflight_put_bytes}); retry later"
            )
        self._reserved = size
        self._key = bytes(key)
        self._size = size
        self._received = 0
        self._parts = []

    def add(self, data: Buffer) -> None:
        """Take the next bytes of the current block; store it once complete.

        A block given whole as ``bytes`` is stored as that very object (no copy).

        Raises:
            RequestError: no block was started, more bytes than declared came,
                or the completed block is not a valid kvtier block.
        """
        if self._key is None:
            raise invalid(
                "PutFrame data before any block was started (the first frame needs a key)"
            )
        if self._received + len(data) > self._size:
            raise invalid(f"block #{self.blocks} declared {self._size} bytes but more data arrived")
        self._parts.append(data)
        self._received += len(data)
        if self._received == self._size:
            self._complete()

    def _complete(self) -> None:
        assert self._key is not None
        # NOTE: joining one exact ``bytes`` object returns it as is: no copy.
        block = b"".join(self._parts)
        self._parts = []
        try:
            verify_block(block, key=self._key)  # a block must be put under its own key
        except CorruptBlockError as e:
            raise invalid(f"block #{self.blocks} is not a valid kvtier block: {e}") from None
        self._access.put(self._tenant, self._key, block)
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
            self._tenant_budget.release(self._reserved)
            self._reserved = 0
