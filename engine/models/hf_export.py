"""Exports the engine's weights as a Hugging Face ``transformers`` model.

For side-by-side checks and benchmarks against transformers on exactly the
weights the engine runs (the fused Q/K/V and gate/up tensors are split back).
``transformers`` is imported lazily: it is a development dependency.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.engine.errors import EngineConfigError
from kvtier.engine.models.config import ModelConfig
from kvtier.engine.models.hf_kernels import bind_installed_kernels
from kvtier.engine.models.llama import DecoderModel


def hf_attention_biases(cfg: ModelConfig) -> tuple[bool, bool]:
    """(Q/K/V biases, output-projection bias) as the transformers class for ``cfg.arch`` has them.

    Llama and Qwen3 have one ``attention_bias`` flag for all four projections;
    Qwen2 always has Q/K/V biases and never an output bias.

    Raises:
        EngineConfigError: for a Qwen2 model with an output-projection bias.
    """
    if cfg.arch == "qwen2":
        if cfg.o_bias:
            raise EngineConfigError("Qwen2 has no output-projection bias in transformers")
        return True, False
    flag = cfg.qkv_bias or cfg.o_bias
    return flag, flag


def hf_state_dict(model: DecoderModel) -> dict[str, torch.Tensor]:
    """``model``'s weights under transformers' names, fused Q/K/V and gate/up split back.

    The split tensors are views of the engine's parameters (clone them before
    mutating or saving). Tied embeddings give no ``lm_head.weight``. A bias
    the transformers class has but the engine's model lacks (see
    ``hf_attention_biases``) is written as zeros, which computes the same.

    Raises:
        EngineConfigError: for a bias layout transformers cannot hold.
    """
    cfg: ModelConfig = model.config
    ours = model.state_dict()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": ours["embed_tokens.weight"],
        "model.norm.weight": ours["norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = ours["lm_head.weight"]
    want_qkv_bias, want_o_bias = hf_attention_biases(cfg)
    for i in range(cfg.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        sd[h + "input_layernorm.weight"] = ours[p + "input_norm.weight"]
        sd[h + "post_attention_layernorm.weight"] = ours[p + "post_norm.weight"]
        qs, ks, vs = ours[p + "attn.qkv_proj.weight"].split([q, kv, kv])
        sd[h + "self_attn.q_proj.weight"] = qs
        sd[h + "self_attn.k_proj.weight"] = ks
        sd[h + "self_attn.v_proj.weight"] = vs
        o = ours[p + "attn.o_proj.weight"]
        sd[h + "self_attn.o_proj.weight"] = o
        qkv_bias = ours.get(p + "attn.qkv_proj.bias")
        if qkv_bias is None and want_qkv_bias:
            qkv_bias = o.new_zeros(q + 2 * kv)
        if qkv_bias is not None:
            qb, kb, vb = qkv_bias.split([q, kv, kv])
            sd[h + "self_attn.q_proj.bias"] = qb
            sd[h + "self_attn.k_proj.bias"] = kb
            sd[h + "self_attn.v_proj.bias"] = vb
        o_bias = ours.get(p + "attn.o_proj.bias")
        if o_bias is None and want_o_bias:
            o_bias = o.new_zeros(cfg.hidden_size)
        if o_bias is not None:
            sd[h + "self_attn.o_proj.bias"] = o_bias
        if cfg.qk_norm:
            sd[h + "self_attn.q_norm.weight"] = ours[p + "attn.q_norm.weight"]
            sd[h + "self_attn.k_norm.weight"] = ours[p + "attn.k_norm.weight"]
        gate, up = ours[p + "mlp.gate_up_proj.weight"].split(cfg.intermediate_size)
        sd[h + "mlp.gate_proj.weight"] = gate
        sd[h + "mlp.up_proj.weight"] = up
        sd[h + "mlp.down_proj.weight"] = ours[p + "mlp.down_proj.weight"]
    return sd


def to_transformers(model: DecoderModel, dtype: torch.dtype | None = None) -> Any:
    """A transformers ``*ForCausalLM`` (SDPA attention, eval mode) holding ``model``'s weights.

    Args:
        model: The engine's decoder.
        dtype: Parameter dtype of the result (default: the same as ``model``).

    Raises:
        EngineConfigError: for RoPE scaling this exporter does not map.
    """
    bind_installed_kernels()  # before transformers: a checkout's kernels/ shadows it
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    cfg: ModelConfig = model.config
    if cfg.rope_scaling is not None or cfg.rope_freq_factors:
        raise EngineConfigError("to_transformers: RoPE scaling is not mapped")
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    hf_cfg: Any
    cls: Any
    bias = hf_attention_biases(cfg)[1]
    if cfg.arch == "llama":
        hf_cfg, cls = LlamaConfig(**common, attention_bias=bias), LlamaForCausalLM
    elif cfg.arch == "qwen2":
        hf_cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        hf_cfg, cls = Qwen3Config(**common, attention_bias=bias), Qwen3ForCausalLM
    hf_cfg._attn_implementation = "sdpa"
    sd = hf_state_dict(model)
    with torch.device("meta"):
        hf = cls(hf_cfg)
    result = hf.load_state_dict(
        {k: v.detach().clone() for k, v in sd.items()}, strict=False, assign=True
    )
    allowed = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - allowed:
        raise EngineConfigError(
            f"to_transformers: state dict mismatch: missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}"
        )
    hf.tie_weights()
    # the rotary buffer was created on the meta device: rebuild it for real
    hf.model.rotary_emb.to_empty(device=next(model.parameters()).device)
    hf.model.rotary_emb.__init__(hf_cfg)
    target: torch.dtype = dtype or next(model.parameters()).dtype
    return hf.to(dtype=target).eval()
