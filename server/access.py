"""What a tenant may see and store: its namespace's slots, provenance stamps and trust.

Every read and write of block data, on both planes, goes through one
:class:`BlockAccess`, so the rules hold alike for gRPC and the data plane:

* **Writes** go to the writer's slot (:mod:`kvtier.server.tenants`) and are
  *stamped*: the writer's tenant name and an HMAC tag (:mod:`kvtier.provenance`)
  are appended to the block, whatever trailer the writer sent.
* **Reads** look in the reader's slots in order (trusted first). A block
  whose stamp names a writer the reader does not accept is withheld (a miss),
  counted in ``kvtier_server_withheld_blocks_total{reason="untrusted"}``.
  What is served is the block as its writer sent it, without the stamp (a
  view: no copy): the wire and the clients' tiers never see trailers.
* **Stamps are checked** where blocks come back from storage that others can
  write (tiers that do not verify their own reads, e.g. Aerospike): the store
  runs :meth:`BlockAccess.check_stamp` on them, so a block planted there
  without a valid stamp is counted corrupt, deleted and missed. Blocks in the
  server's memory and its private disk directory are not hashed again.
* **Reports** (a reader's verification found a block wrong): the block the
  reader would be served is deleted and counted against the writer its
  stamp names (``kvtier_server_bad_blocks_total{writer}``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.provenance import check, stamp, unstamped, writer_of
from kvtier.server.metrics import ServerMetrics
from kvtier.server.tenants import Tenant, TenantDirectory
from kvtier.store import TieredStore
from kvtier.tier_events import TierEventLog
from kvtier.wire.frames import Buffer

log = logging.getLogger(__name__)


def provenance_secret(path: Path | None) -> bytes:
    """The stamping secret: SHA-256 of the key file's contents, or random for this process.

    Raises:
        ConfigError: the file cannot be read or holds fewer than 16 bytes.
    """
    if path is None:
        return os.urandom(32)
    try:
        raw = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(
            f"server.provenance_key_file: cannot read {path}: {e.strerror or e}"
        ) from None
    if len(raw) < 16:
        raise ConfigError(
            f"server.provenance_key_file: {path} holds {len(raw)} bytes; at least 16 are needed"
        )
    return hashlib.sha256(b"kvtier-provenance-secret\0" + raw).digest()


class BlockAccess:
    """A tenant's view of the store (see the module docstring). Thread-safe.

    Args:
        store: The server's store.
        directory: Tenants (labels of writers for metrics).
        metrics: Server metrics.
        secret: The stamping secret.
    """

    def __init__(
        self,
        store: TieredStore,
        directory: TenantDirectory,
        metrics: ServerMetrics,
        secret: bytes,
    ) -> None:
        self.store = store
        self.directory = directory
        self.metrics = metrics
        self._secret = secret
        self.events: TierEventLog | None = None
        """Where stored and removed keys are recorded for routers (``GET /tier_events``)."""

    # -- reads ---------------------------------------------------------------------

    def present(self, tenant: Tenant, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held in one of the tenant's slots."""
        found = [False] * len(keys)
        for scoped in tenant.read_scopes(keys):
            todo = [i for i, f in enumerate(found) if not f]
            if not todo:
                break
            for i, f in zip(todo, self.store.contains([scoped[i] for i in todo]), strict=True):
                found[i] = f
        return found

    def prefix(self, tenant: Tenant, keys: Sequence[bytes]) -> int:
        """How many leading keys are held (prefix semantics)."""
        if len(tenant.read_salts) == 1:
            return self.store.lookup(tenant.read_scopes(keys)[0])
        n = 0
        for f in self.present(tenant, keys):
            if not f:
                break
            n += 1
        return n

    def get(self, tenant: Tenant, keys: Sequence[bytes]) -> list[Buffer | None]:
        """The blocks of ``keys`` the tenant may be served (``None``: a miss).

        Each carries the caller's key (checked by the store); the stamp is
        cut off (a view of the stored block).
        """
        out: list[Buffer | None] = [None] * len(keys)
        for scoped in tenant.read_scopes(keys):
            todo = [i for i, b in enumerate(out) if b is None]
            if not todo:
                break
            blocks = self.store.get([scoped[i] for i in todo], bound_to=[keys[i] for i in todo])
            for i, block in zip(todo, blocks, strict=True):
                if block is None:
                    continue
                if not tenant.accepts(writer_of(block)):
                    self.metrics.withheld_blocks.labels("untrusted").inc()
                    continue
                out[i] = unstamped(block)
        return out

    # -- writes --------------------------------------------------------------------

    def put(self, tenant: Tenant, key: bytes, block: bytes) -> None:
        """Stamp a verified ``block`` with its writer and store it in the writer's slot."""
        (scoped,) = tenant.scope([key])
        stamped = stamp(block, writer=tenant.name, secret=self._secret, scope=scoped)
        self.store.put([(scoped, stamped)])
        if self.events is not None:
            self.events.record("stored", [(scoped, key)])

    def delete(self, tenant: Tenant, keys: Sequence[bytes]) -> int:
        """Delete keys from the tenant's own slot (a writer never deletes a more trusted one)."""
        if not keys:
            return 0
        scoped = tenant.scope(keys)
        deleted = self.store.delete(scoped)
        if self.events is not None and deleted:
            self.events.record("removed", zip(scoped, keys, strict=True))
        return deleted

    def report_bad(self, tenant: Tenant, keys: Sequence[bytes]) -> int:
        """The tenant's verification found these blocks wrong: delete what it would be served.

        Each block found is deleted from its slot and counted against the
        writer its stamp names. Returns how many were found and deleted.
        """
        reporter = tenant.label
        self.metrics.bad_block_reports.labels(reporter).inc(len(keys))
        deleted = 0
        for i, key in enumerate(keys):
            for scoped in tenant.read_scopes([key]):
                block = self.store.get(scoped, bound_to=[key])[0]
                if block is None:
                    continue
                writer = writer_of(block)
                self.store.delete(scoped)
                if self.events is not None:
                    self.events.record("removed", [(scoped[0], key)])
                self.metrics.bad_blocks.labels(self.directory.label_of(writer)).inc()
                log.warning(
                    "tenant %s reported block %s (key #%d) of writer %s wrong; deleted",
                    tenant.name,
                    key.hex(),
                    i,
                    writer or "(unstamped)",
                )
                deleted += 1
                break
        return deleted

    # -- the store's check of blocks read back from shared storage --------------------

    def check_stamp(self, scoped: bytes, block: bytes) -> None:
        """Raise unless ``block``, read under ``scoped``, carries a stamp of this server.

        Raises:
            CorruptBlockError: no stamp, or one that does not verify.
        """
        try:
            check(block, secret=self._secret, scope=scoped)
        except CorruptBlockError:
            self.metrics.withheld_blocks.labels("provenance").inc()
            raise
