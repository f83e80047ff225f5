"""Build tiers and stores from configuration."""

from __future__ import annotations

from kvtier.config import (
    AerospikeTierConfig,
    CpuTierConfig,
    DiskTierConfig,
    KvtierConfig,
    LatencyTierConfig,
    RemoteTierConfig,
    TierConfig,
)
from kvtier.errors import ConfigError
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.eviction import make_policy


def build_tier(config: TierConfig, metrics: StoreMetrics | None = None) -> Tier:
    """One tier from its configuration section.

    Raises:
        ConfigError: the tier cannot be built (e.g. its directory is not writable).
    """
    if isinstance(config, LatencyTierConfig):
        from kvtier.tiers.latency import LatencyTier

        return LatencyTier(
            build_tier(config.tier, metrics),
            get_s=config.get_ms / 1000,
            contains_s=config.contains_ms / 1000,
            put_s=config.put_ms / 1000,
            name=config.name,
        )
    if isinstance(config, CpuTierConfig):
        return CpuTier(
            config.capacity, make_policy(config.eviction), metrics=metrics, name=config.name
        )
    if isinstance(config, DiskTierConfig):
        try:
            return DiskTier(
                config.path,
                config.capacity,
                make_policy(config.eviction),
                fsync=config.fsync,
                rescan_s=config.rescan_s,
                metrics=metrics,
                name=config.name,
            )
        except OSError as e:
            raise ConfigError(
                f"tiers[{config.name}].path: cannot use {config.path}: {e.strerror or e}"
            ) from None
    if isinstance(config, AerospikeTierConfig):
        try:
            from kvtier.tiers.aerospike import AerospikeTier
        except ImportError as e:
            raise ConfigError(
                f"tiers[{config.name}]: the Aerospike tier needs the `aerospike` client "
                f"(pip install -e '.[aerospike]'): {e}"
            ) from None
        return AerospikeTier(config, metrics)
    if isinstance(config, RemoteTierConfig):
        try:
            from kvtier.tiers.remote import RemoteTier
        except ImportError as e:
            raise ConfigError(
                f"tiers[{config.name}]: the remote tier needs grpcio (pip install -e '.[server]'): {e}"
            ) from None
        return RemoteTier(config, metrics=metrics)
    raise ConfigError(f"unsupported tier type {config.type!r}")


def build_store(config: KvtierConfig, metrics: StoreMetrics | None = None) -> TieredStore:
    """A :class:`TieredStore` with the configured tiers and write policy."""
    metrics = metrics if metrics is not None else StoreMetrics()
    tiers: list[Tier] = []
    try:
        for section in config.tiers:
            tiers.append(build_tier(section, metrics))
        return TieredStore(
            tiers,
            write_policy=config.store.write_policy,
            selective_hits=config.store.selective_hits,
            writer_queue=config.store.writer_queue,
            flush_on_close=config.store.flush_on_close,
            metrics=metrics,
        )
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
