"""``ModelConfig``: the shape of a Llama-family decoder, read from HF or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.errors import EngineConfigError

# Architectures this engine runs, as HF ``model_type`` / GGUF ``general.architecture``.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_scaling``).

    Attributes:
        kind: ``"llama3"`` or ``"linear"``.
        factor: Scaling factor.
        low_freq_factor: Llama 3 only.
        high_freq_factor: Llama 3 only.
        original_max_position_embeddings: Llama 3 only.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder-only model.

    Attributes:
        arch: ``llama`` (Llama 2/3, SmolLM), ``qwen2`` (QKV bias) or ``qwen3`` (QK-norm).
        head_dim: Per-head size; ``hidden_size // num_heads`` unless the model says otherwise.
        qkv_bias: Q, K and V projections carry a bias.
        o_bias: The output projection carries a bias.
        qk_norm: RMSNorm over each head of Q and K before RoPE (Qwen3).
        rope_freq_factors: Per-frequency divisors (GGUF ``rope_freqs``), or empty.
        eos_token_ids: Tokens that end generation.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise EngineConfigError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise EngineConfigError(
                    f"model config: {name} must be a positive integer, got {v!r}"
                )
        if self.num_heads % self.num_kv_heads:
            raise EngineConfigError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise EngineConfigError(f"model config: head_dim must be even, got {self.head_dim}")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:
            raise EngineConfigError(
                f"model config: rope_freqs has {len(self.rope_freq_factors)} entries, "
                f"expected head_dim/2 = {self.head_dim // 2}"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements of K and V per token over all layers (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _rope_scaling_from_hf(raw: dict[str, Any] | None, rope_theta: float) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(raw["factor"]))
    raise EngineConfigError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")


def model_config_from_hf(
    cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None
) -> ModelConfig:
    """Builds a ``ModelConfig`` from a Hugging Face ``config.json`` dict.

    Raises:
        EngineConfigError: for unsupported architectures or features.
    """
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise EngineConfigError(
            f"unsupported model_type {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    if cfg.get("use_sliding_window"):
        raise EngineConfigError("sliding-window attention is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise EngineConfigError(f"unsupported hidden_act {act!r} (only silu)")
    if cfg.get("mlp_bias"):
        raise EngineConfigError("mlp_bias is not supported")
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        # NOTE: transformers 5 moved rope_theta/rope_scaling into rope_parameters.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        scaling_raw = cfg.get("rope_scaling") or rope_params or None
        eos: Any = None
        if generation_cfg:
            eos = generation_cfg.get("eos_token_id")
        if eos is None:
            eos = cfg.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else ((int(eos),) if eos is not None else ())
        )
        bias = bool(cfg.get("attention_bias", False))
        return ModelConfig(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "qwen2" else bias,
            o_bias=bias if arch == "llama" else False,
            qk_norm=arch == "qwen3",
            rope_scaling=_rope_scaling_from_hf(scaling_raw, rope_theta),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as e:
        raise EngineConfigError(f"config.json lacks required key {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        if isinstance(e, EngineConfigError):
            raise
        raise EngineConfigError(f"config.json has a malformed value: {e}") from e


def model_config_from_gguf(
    meta: dict[str, Any],
    vocab_size: int,
    tie_word_embeddings: bool,
    qkv_bias: bool,
    rope_freq_factors: tuple[float, ...] = (),
) -> ModelConfig:
    """Builds a ``ModelConfig`` from GGUF key/values.

    Args:
        meta: GGUF metadata, key -> decoded value.
        vocab_size: Rows of the token embedding tensor.
        tie_word_embeddings: True when the file has no ``output.weight``.
        qkv_bias: True when the file has ``attn_q.bias``.
        rope_freq_factors: Values of ``rope_freqs.weight`` when present.

    Raises:
        EngineConfigError: for unsupported architectures or missing keys.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise EngineConfigError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise EngineConfigError(f"GGUF metadata lacks {arch}.{key}")
        return v

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise EngineConfigError(
            f"partial rotary embeddings are not supported (rope dims {rot}, head dim {head_dim})"
        )
    scaling: RopeScaling | None = None
    stype = meta.get(f"{arch}.rope.scaling.type")
    if stype == "linear":
        scaling = RopeScaling(kind="linear", factor=float(get("rope.scaling.factor")))
    elif stype not in (None, "none"):
        raise EngineConfigError(f"unsupported GGUF rope scaling type {stype!r}")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=tie_word_embeddings,
        qkv_bias=qkv_bias,
        qk_norm=arch == "qwen3",
        rope_scaling=scaling,
        rope_freq_factors=rope_freq_factors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
    )
