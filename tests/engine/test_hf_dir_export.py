"""``kvtier model export-hf``: a GGUF written back as a Hugging Face directory runs the same model.

The same weights reach the engine either way (dequantized GGUF tensors, split
back from the engine's fused Q/K/V and gate/up, saved and fused again), and
the engine computes the same way on them, so in float32 the logits must be
bitwise equal, not merely close. transformers is a different implementation:
it is held to equal greedy tokens and equal token ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from kvtier.cli import main
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.models.hf_dir_export import MARKER, ModelExportError, export_hf_dir
from kvtier.engine.models.loader import load_tokenizer
from tests.engine.gguf_files import write_gguf
from tests.engine.test_model_loading import TEXTS, _spm_vocab
from tests.engine.tiny_models import hf_config, hf_greedy, random_model, write_tiny_model

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # SmolLM2's shape: tied embeddings, GQA, no biases, rope_theta 1e5, eps 1e-5
    "llama-tied": (
        "llama",
        {"tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-5},
    ),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm": ("qwen3", {}),
}


def _llm(path: Path, dtype: str = "float32") -> LLM:
    return LLM(str(path), dtype=dtype, device="cpu", block_size=4, num_threads=1)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 23)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(GGUF path, float32 export, bfloat16 export, HF config) of one tiny random model."""
    arch, overrides = VARIANTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    d, model = write_tiny_model(root / "hf", arch, seed=13, **overrides)
    gguf_path = root / "m.gguf"
    write_gguf(model, d, gguf_path)
    f32 = export_hf_dir(gguf_path, root / "out-f32", dtype="float32")
    bf16 = export_hf_dir(gguf_path, root / "out-bf16")
    assert f32.written and bf16.written
    return gguf_path, f32.path, bf16.path, model.config


def test_export_runs_in_the_engine_exactly_like_the_gguf(exported) -> None:
    gguf_path, f32_dir, bf16_dir, hf_cfg = exported
    prompts = _prompts(hf_cfg.vocab_size)
    from_gguf, from_dir = _llm(gguf_path), _llm(f32_dir)
    for p in prompts:
        a = from_gguf.engine.score(p, use_prefix_cache=False).logits
        b = from_dir.engine.score(p, use_prefix_cache=False).logits
        assert torch.equal(a, b)
    reference = [o.token_ids for o in from_gguf.generate(prompts, GREEDY)]
    assert [o.token_ids for o in from_dir.generate(prompts, GREEDY)] == reference
    # bfloat16: the engine rounds the same dequantized weights either way
    bf_gguf, bf_dir = _llm(gguf_path, "bfloat16"), _llm(bf16_dir, "bfloat16")
    p = prompts[1]
    assert torch.equal(
        bf_gguf.engine.score(p, use_prefix_cache=False).logits,
        bf_dir.engine.score(p, use_prefix_cache=False).logits,
    )
    assert [o.token_ids for o in bf_dir.generate(prompts, GREEDY)] == [
        o.token_ids for o in bf_gguf.generate(prompts, GREEDY)
    ]


def test_export_files_are_what_transformers_expects(exported) -> None:
    _, f32_dir, bf16_dir, hf_cfg = exported
    config = json.loads((bf16_dir / "config.json").read_text())
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
        assert config[key] == getattr(hf_cfg, key)
    assert config["tie_word_embeddings"] == hf_cfg.tie_word_embeddings
    assert config["rms_norm_eps"] == hf_cfg.rms_norm_eps  # the float32 GGUF value, as written
    assert config["rope_theta"] == hf_cfg.rope_parameters["rope_theta"]
    assert config["eos_token_id"] == hf_cfg.eos_token_id
    assert config["dtype"] == "bfloat16"
    for directory, dtype in ((bf16_dir, torch.bfloat16), (f32_dir, torch.float32)):
        with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
            names = set(f.keys())
            assert {f.get_tensor(n).dtype for n in names} == {dtype}
        assert ("lm_head.weight" in names) == (not hf_cfg.tie_word_embeddings)
        assert "model.layers.0.self_attn.k_proj.weight" in names
        assert "model.layers.0.mlp.gate_proj.weight" in names
        assert not any("qkv" in n or "gate_up" in n for n in names)
    tok_cfg = json.loads((bf16_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tok_cfg["chat_template"]
    generation = json.loads((bf16_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == hf_cfg.eos_token_id


def test_export_runs_in_transformers_with_the_same_tokens(exported) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, f32_dir, _, hf_cfg = exported
    hf = AutoModelForCausalLM.from_pretrained(str(f32_dir), dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings == hf_cfg.tie_word_embeddings
    engine = _llm(gguf_path)
    prompts = _prompts(hf_cfg.vocab_size)
    outs = engine.generate(prompts, GREEDY)
    assert [hf_greedy(hf, p, MAX_TOKENS) for p in prompts] == [o.token_ids for o in outs]

    ours, reloaded = load_tokenizer(gguf_path), load_tokenizer(f32_dir)
    for text in TEXTS:
        assert reloaded.encode(text) == ours.encode(text), text
    if hf_cfg.model_type != "llama":
        # NOTE: transformers 5 always loads its own Qwen2Tokenizer for model_type
        # qwen2/qwen3, with Qwen's split pattern hard-coded; a real Qwen GGUF has
        # that pattern (tokenizer.ggml.pre "qwen2"), this tiny test vocabulary has GPT-2's.
        return
    hf_tok = AutoTokenizer.from_pretrained(str(f32_dir))
    for text in TEXTS:
        ids = ours.encode(text)
        assert hf_tok(text)["input_ids"] == ids, text
        assert hf_tok.decode(ids, skip_special_tokens=True) == ours.decode(ids), text
    msgs = [{"role": "user", "content": "hi"}]
    rendered = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.apply_chat_template(msgs)
    assert hf_tok.eos_token_id == ours.eos_token_id


def test_sentencepiece_export_adds_bos_like_the_engine(tmp_path: Path) -> None:
    """A GGUF whose tokenizer adds BOS (SentencePiece): every reader of the export adds it once."""
    from transformers import AutoTokenizer

    vocab = _spm_vocab()
    model = random_model(hf_config("llama", len(vocab), bos_token_id=1, eos_token_id=2), seed=4)
    path = tmp_path / "spm.gguf"
    write_gguf(model, None, path, spm_vocab=vocab)
    out = export_hf_dir(path, tmp_path / "out").path
    ours, reloaded = load_tokenizer(path), load_tokenizer(out)
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    for text in [*TEXTS[:4], "unseen wörds ☃", " leading space"]:
        ids = ours.encode(text)
        assert ids[0] == 1 and ids[1] != 1
        assert hf_tok(text)["input_ids"] == ids, text
        assert reloaded.encode(text) == ids, text
        assert reloaded.decode(ids) == ours.decode(ids)


def test_export_again_is_a_no_op_and_other_content_is_not_overwritten(tmp_path: Path) -> None:
    d, model = write_tiny_model(tmp_path / "hf", "llama", seed=2)
    gguf_path = tmp_path / "m.gguf"
    write_gguf(model, d, gguf_path)
    out = tmp_path / "out"
    first = export_hf_dir(gguf_path, out)
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = export_hf_dir(gguf_path, out)
    assert first.written and not again.written
    assert again.fingerprint == first.fingerprint
    assert again.num_tensors == first.num_tensors
    assert weights.stat().st_mtime_ns == stamp
    # another dtype is another export: refused without force, replaced with it
    with pytest.raises(ModelExportError, match="--force"):
        export_hf_dir(gguf_path, out, dtype="float32")
    assert export_hf_dir(gguf_path, out, dtype="float32", force=True).written
    assert json.loads((out / MARKER).read_text())["dtype"] == "float32"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers
    # with force, the same export again is still a no-op
    stamp = weights.stat().st_mtime_ns
    assert not export_hf_dir(gguf_path, out, dtype="float32", force=True).written
    assert weights.stat().st_mtime_ns == stamp
    # a damaged export is not taken for a finished one: it is written again
    weights.write_bytes(b"truncated")
    assert export_hf_dir(gguf_path, out, dtype="float32").written
    assert weights.stat().st_size > len(b"truncated")
    # an export made before the fingerprint scheme (or the exporter) changed is replaced
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps({**marker, "source_fingerprint": "old-scheme"}))
    assert export_hf_dir(gguf_path, out, dtype="float32").written
    assert json.loads((out / MARKER).read_text())["source_fingerprint"] == first.fingerprint
    # ... but not an export of another source file
    other_model = {"source": str(tmp_path / "x.gguf"), "source_fingerprint": "another-model"}
    (out / MARKER).write_text(json.dumps({**marker, **other_model}))
    with pytest.raises(ModelExportError, match="not empty"):
        export_hf_dir(gguf_path, out, dtype="float32")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ModelExportError, match="not empty"):
        export_hf_dir(gguf_path, other)
    assert (other / "notes.txt").read_text() == "keep me"
    with pytest.raises(ModelExportError, match="not a directory"):
        export_hf_dir(gguf_path, other / "notes.txt")
    with pytest.raises(ModelExportError, match="dtype"):
        export_hf_dir(gguf_path, tmp_path / "x", dtype="float16")
    (tmp_path / "empty").mkdir()
    assert export_hf_dir(gguf_path, tmp_path / "empty").written


def test_cli_export_hf(tmp_path: Path) -> None:
    d, model = write_tiny_model(tmp_path / "hf", "qwen2", seed=6)
    gguf_path = tmp_path / "m.gguf"
    write_gguf(model, d, gguf_path)
    out = tmp_path / "out"

    def run(*args: str) -> Any:
        env = {"KVTIER_MODEL_DIR": str(tmp_path / "models")}
        return CliRunner().invoke(main, ["model", "export-hf", *args], env=env)

    ok = run(str(gguf_path), str(out), "--dtype", "float32")
    assert ok.exit_code == 0, ok.output
    assert ok.stdout == f"{out}\n"
    assert "wrote" in ok.stderr and "float32" in ok.stderr
    again = run(str(gguf_path), str(out), "--dtype", "float32")
    assert again.exit_code == 0 and "nothing to do" in again.stderr
    clash = run(str(gguf_path), str(out))
    assert clash.exit_code == 1 and "pass --force" in clash.stderr
    assert run(str(gguf_path), str(out), "--force").exit_code == 0
    unknown = run("llama-9000", str(tmp_path / "u"))
    assert unknown.exit_code == 1
    assert "unknown model 'llama-9000'; known models: smollm2" in unknown.stderr
    missing = run("smollm2", str(tmp_path / "s"))  # known, but not fetched into this model dir
    assert missing.exit_code == 1 and "run: kvtier model fetch smollm2" in missing.stderr
    assert not (tmp_path / "u").exists() and not (tmp_path / "s").exists()


@pytest.mark.smollm2
def test_smollm2_export_gives_the_engines_tokens_in_transformers(
    smollm2: Path, smollm2_llm: LLM, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_hf_dir(smollm2, tmp_path / "smollm2-hf", dtype="float32").path
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = smollm2_llm.engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert hf_tok(rendered, add_special_tokens=False)["input_ids"] == prompt
    expected = smollm2_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert hf_greedy(hf, prompt, len(expected.token_ids)) == expected.token_ids
    assert os.path.getsize(out / "model.safetensors") > 500 * 2**20  # float32, 135M parameters
