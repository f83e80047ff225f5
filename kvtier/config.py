"""The kvtier configuration: one typed, strict model, loaded from YAML.

Precedence, lowest first: built-in defaults, the YAML file, then environment
overrides. An override is ``KVTIER_<PATH>`` where ``<PATH>`` is the key path
in upper case with ``__`` between levels and list indices as numbers::

    KVTIER_CHUNK_SIZE=512
    KVTIER_STORE__WRITE_POLICY=write_back
    KVTIER_TIERS__0__CAPACITY=2GiB

Values are parsed as YAML scalars (``512`` is an int, ``true`` a bool).
``KVTIER_CONFIG`` names the file; a few other ``KVTIER_`` variables that are
not configuration keys are listed in :data:`NON_CONFIG_ENV`. Anything else
that looks like an override but names no key is an error, as is an unknown
key, a bad unit or an impossible value in the file: the message names the key.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from kvtier.errors import ConfigError
from kvtier.server_config import ServerConfig
from kvtier.tiers.aerospike_config import AerospikeTierConfig
from kvtier.tiers.remote_config import RemoteTierConfig
from kvtier.units import parse_bytes

ENV_PREFIX = "KVTIER_"
NON_CONFIG_ENV = frozenset(
    {
        "KVTIER_CONFIG",
        "KVTIER_MODEL_DIR",
        "KVTIER_CACHE_DIR",
        "KVTIER_LOG_LEVEL",
        "KVTIER_HOME",
        "KVTIER_AEROSPIKE_HOST",  # tests: run the Aerospike tier tests against a real server
        "KVTIER_AEROSPIKE_NAMESPACE",
        "KVTIER_TEST_PYPI",  # tests: allow the real model download
        "KVTIER_MALLOC_RETAIN",  # the command line's allocator tuning (kvtier/allocator.py)
        "KVTIER_API_KEY",  # kvtier engine serve --api-key
        "KVTIER_SERVER_TOKEN",  # kvtier stats --token
        "KVTIER_ROUTER_API_KEY",  # kvtier router --api-key
        "KVTIER_ENGINE_API_KEY",  # kvtier router --engine-api-key
    }
)
"""``KVTIER_`` variables that are not configuration overrides."""

DEFAULT_CACHE_DIR = Path("~/.cache/kvtier")


def _bytes(value: Any) -> int:
    return parse_bytes(value)


ByteSize = Annotated[int, BeforeValidator(_bytes), Field(gt=0)]
"""A positive byte count, written as ``4GiB``, ``512MB`` or an int."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CpuTierConfig(_Strict):
    """An in-process memory tier."""

    type: Literal["cpu"] = "cpu"
    name: str = "cpu"
    capacity: ByteSize = parse_bytes("1GiB")
    eviction: Literal["lru", "fifo", "lfu"] = "lru"


class DiskTierConfig(_Strict):
    """A local directory of block files."""

    type: Literal["disk"] = "disk"
    name: str = "disk"
    path: Path = DEFAULT_CACHE_DIR / "blocks"
    capacity: ByteSize = parse_bytes("8GiB")
    eviction: Literal["lru", "fifo", "lfu"] = "lru"
    fsync: bool = False
    rescan_s: float = Field(
        10.0, ge=0, description="rescan the directory for other processes' files this often"
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_shared(cls, data: Any) -> Any:
        # NOTE: every disk tier is safe for several processes now (docs/architecture.md);
        # `shared` from older files is accepted so they keep loading.
        if isinstance(data, dict) and "shared" in data:
            logging.getLogger(__name__).warning(
                "tiers[%s].shared is no longer needed: every disk tier may be used by several "
                "processes at once; remove the key",
                data.get("name", "disk"),
            )
            data = {k: v for k, v in data.items() if k != "shared"}
        return data


InnerTierConfig = Annotated[
    CpuTierConfig | DiskTierConfig | AerospikeTierConfig | RemoteTierConfig,
    Field(discriminator="type"),
]


class LatencyTierConfig(_Strict):
    """Another tier behind a fixed added latency: to measure what a slow tier does."""

    type: Literal["latency"] = "latency"
    name: str = Field("", description="label; the inner tier's name when empty")
    get_ms: float = Field(0.0, ge=0, le=60_000, description="added to every get")
    contains_ms: float = Field(0.0, ge=0, le=60_000, description="added to every lookup")
    put_ms: float = Field(0.0, ge=0, le=60_000, description="added to every background put")
    tier: InnerTierConfig

    @model_validator(mode="after")
    def _name(self) -> LatencyTierConfig:
        if not self.name:
            object.__setattr__(self, "name", self.tier.name)
        return self


TierConfig = Annotated[
    CpuTierConfig | DiskTierConfig | AerospikeTierConfig | RemoteTierConfig | LatencyTierConfig,
    Field(discriminator="type"),
]


class BlockConfig(_Strict):
    """How chunks are encoded into blocks."""

    encoding: Literal["raw", "int8", "fp8_e4m3"] = "raw"
    # NOTE: none by default: measured on activation-like bf16 KV, lz4 saves
    # under 1% and costs 2x the encode time (docs/architecture.md, bench/RESULTS.md).
    compression: Literal["none", "lz4"] = "none"


class KeysConfig(_Strict):
    """How chunk keys are made (``kvtier/keys.py``, ``docs/security.md``)."""

    hash: Literal["sha256", "xxh3"] = Field(
        "sha256",
        description="chain hash of chunk keys: sha256 (collision resistant: prompts from "
        "anyone) or xxh3 (faster; only when every prompt comes from one trusted party)",
    )


class StoreConfig(_Strict):
    """How the tiers are composed."""

    write_policy: Literal["write_through", "write_back", "selective"] = "write_through"
    selective_hits: int = Field(2, ge=1)
    writer_queue: int = Field(1024, ge=1)
    flush_on_close: bool = True


SHARED_VERIFY_FRACTION = 0.01
"""``connector.verify_fraction`` when it is null and a tier is shared (docs/security.md)."""


class ConnectorConfig(_Strict):
    """The engine side: what to look up, load and save."""

    min_load_tokens: int = Field(16, ge=1, description="do not load a hit shorter than this")
    save_decode: bool = Field(
        True,
        description="also save what a request generates (chunks completed while decoding, "
        "and the tail of prompt + answer when it ends), so a conversation's next round loads it",
    )
    load_timeout_s: float = Field(
        5.0, gt=0, description="deadline of one request's whole load, retries included"
    )
    lookup_timeout_s: float = Field(
        1.0,
        gt=0,
        description="deadline of one request's prefix lookup, retries included; "
        "a lookup not answered by then is a miss (the request waits for it, the batch does not)",
    )
    load_workers: int = Field(
        4,
        ge=1,
        le=64,
        description="I/O threads fetching loads and lookups; beyond them loads are refused",
    )
    save_queue: int = Field(
        64, ge=1, description="requests' chunks waiting to be saved before dropping"
    )
    # NOTE: null (auto) by default: on where a tier is shared with other principals
    # (effective_verify_fraction); with tiers only this user writes, checksums and key
    # binding already cover what can go wrong, and sampling costs prefill (docs/security.md).
    verify_fraction: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="probability that a loaded chunk is recomputed and compared with its stored "
        "block (a mismatch is counted, deleted from every tier and quarantined); null: "
        f"{SHARED_VERIFY_FRACTION} when a tier is shared (remote, aerospike, a disk directory "
        "other users can write), else 0. Costs about verify_fraction*(n+1)/2 of an n-chunk "
        "prefix's tokens",
    )


class MetricsConfig(_Strict):
    """Prometheus exposition by the process that runs the connector (``kvtier/metrics_http.py``).

    ``kvtier serve`` refuses ``port``: its ``server.http_port`` serves /metrics.
    """

    port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="the KV connector serves its store's metrics at http://host:port/metrics "
        "(0: any free port, logged; null: off — kvtier engine serve's /metrics has them anyway)",
    )
    host: str = Field(
        "127.0.0.1", min_length=1, description="address of that endpoint (no token: keep it local)"
    )


def _default_tiers() -> list[TierConfig]:
    """CPU in front of local disk: the embedded default, a complete product."""
    return [CpuTierConfig(), DiskTierConfig()]


class KvtierConfig(_Strict):
    """Everything kvtier needs, one place."""

    chunk_size: int = Field(256, ge=16, le=65536)
    page_tokens: int = Field(
        16,
        ge=1,
        description="key granularity: a stored prefix is found to this many tokens (a page; "
        "'block' means a stored object, `block:`)",
    )
    save_partial_chunks: bool = Field(
        True,
        description="save tails: the page-aligned part of an unfinished last chunk, when a "
        "prompt's prefill ends (and, with save_decode, when a request ends)",
    )
    keys: KeysConfig = KeysConfig()
    block: BlockConfig = BlockConfig()
    store: StoreConfig = StoreConfig()
    tiers: list[TierConfig] = Field(default_factory=_default_tiers, min_length=1)
    connector: ConnectorConfig = ConnectorConfig()
    metrics: MetricsConfig = MetricsConfig()
    server: ServerConfig = Field(default_factory=ServerConfig)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        # NOTE: `block_tokens` was renamed `page_tokens` (issue 18: "block" names a stored
        # object); files that still say it keep loading.
        if isinstance(data, dict) and "block_tokens" in data and "page_tokens" not in data:
            logging.getLogger(__name__).warning("block_tokens is now called page_tokens")
            data = {("page_tokens" if k == "block_tokens" else k): v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _check(self) -> KvtierConfig:
        if self.chunk_size % 16:
            raise ValueError(
                f"chunk_size must be a multiple of 16 (the engine block size), got {self.chunk_size}"
            )
        if self.chunk_size % self.page_tokens:
            raise ValueError(
                f"page_tokens ({self.page_tokens}) must divide chunk_size ({self.chunk_size})"
            )
        names = [t.name for t in self.tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tier names must be unique; repeated: {dupes} (set `name:` on each)")
        return self


def shared_tiers(config: KvtierConfig) -> list[str]:
    """Tiers other principals can write: remote and Aerospike tiers, and disk tiers whose
    directory other users can write (group/other write, or owned by another user)."""
    from kvtier.tiers.disk_files import is_shared_dir

    out = []
    for t in config.tiers:
        inner = t.tier if isinstance(t, LatencyTierConfig) else t
        if isinstance(inner, AerospikeTierConfig | RemoteTierConfig) or (
            isinstance(inner, DiskTierConfig) and is_shared_dir(inner.path.expanduser())
        ):
            out.append(t.name)
    return out


def effective_verify_fraction(config: KvtierConfig) -> float:
    """``connector.verify_fraction``, or when null :data:`SHARED_VERIFY_FRACTION` if a tier is
    shared (:func:`shared_tiers`) and 0 otherwise."""
    f = config.connector.verify_fraction
    if f is not None:
        return f
    return SHARED_VERIFY_FRACTION if shared_tiers(config) else 0.0


def _format_error(e: ValidationError, source: str) -> str:
    lines = [f"invalid kvtier configuration ({source}):"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def _env_overrides(env: Mapping[str, str]) -> list[tuple[list[str], Any]]:
    fields = set(KvtierConfig.model_fields)
    out: list[tuple[list[str], Any]] = []
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name in NON_CONFIG_ENV:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        if path[0] not in fields:
            close = difflib.get_close_matches(path[0], fields, n=1)
            if "__" in name or close:
                hint = f" (did you mean KVTIER_{close[0].upper()}?)" if close else ""
                raise ConfigError(f"environment variable {name} names no configuration key{hint}")
            continue  # some other tool's KVTIER_ variable
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError as e:
            raise ConfigError(f"environment variable {name}: cannot parse {raw!r}: {e}") from None
        out.append((path, value))
    return out


def _apply(data: dict[str, Any], path: list[str], value: Any, env_name: str) -> None:
    node: Any = data
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(
                    f"{env_name}: no list item {part!r} at {'.'.join(path[:i]) or 'top level'}"
                )
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ConfigError(f"{env_name}: {'.'.join(path[:i])} is not a section")


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> KvtierConfig:
    """Build the effective configuration.

    Args:
        path: A YAML file; ``None`` uses ``$KVTIER_CONFIG`` if set, else defaults.
        env: Environment to read overrides from (``os.environ`` by default).
        overrides: Top-level keys applied last (for programmatic use).

    Raises:
        ConfigError: The file is missing or malformed, or a key or value is
            invalid; the message names every bad key.
    """
    env = os.environ if env is None else env
    if path is None:
        path = env.get("KVTIER_CONFIG") or None
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path).expanduser()
        source = str(p)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read configuration file {p}: {e.strerror or e}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"configuration file {p} is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"configuration file {p} must hold a mapping at the top level")
        data = loaded
    env_items = _env_overrides(env)
    if env_items:
        if "tiers" not in data and any(p[0] == "tiers" for p, _ in env_items):
            data["tiers"] = [t.model_dump(mode="json") for t in KvtierConfig().tiers]
        for p_, value in env_items:
            _apply(data, p_, value, ENV_PREFIX + "__".join(p_).upper())
        source += " + environment"
    if overrides:
        data.update(overrides)
    try:
        return KvtierConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, source)) from None


def dump_config(config: KvtierConfig) -> str:
    """The configuration as YAML (what ``kvtier config show`` prints)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
