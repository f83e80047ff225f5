"""GGUF and Hugging Face-directory loading: weights, Q/K un-permutation, tokenizer, fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer

from kvtier.engine import LLM, EngineConfigError, ModelLoadError, SamplingParams
from kvtier.engine.models.loader import load_model, load_tokenizer
from tests.engine.gguf_files import write_gguf
from tests.engine.tiny_models import _CORPUS, hf_greedy, hf_logits, write_tiny_model

Q = gguf.GGMLQuantizationType
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TEXTS = [*_CORPUS[:4], "  leading spaces and\ttabs\n\nnew lines", "<|im_start|>user\nhi<|im_end|>"]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 17, 29)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_matches_transformers(arch: str, tmp_path: Path) -> None:
    d, model = write_tiny_model(tmp_path / "hf", arch, seed=3)
    path = tmp_path / "m.gguf"
    write_gguf(model, d, path)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, num_threads=1)
    prompts = _prompts(model.config.vocab_size)
    for p in prompts:
        torch.testing.assert_close(
            llm.engine.score(p, use_prefix_cache=False).logits,
            hf_logits(model, p),
            atol=1e-4,
            rtol=1e-4,
        )
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 8) for p in prompts]


def test_quantized_gguf_matches_its_dequantized_weights(tmp_path: Path) -> None:
    """Q8_0/Q4_0/Q4_1/F16/BF16 tensors, Q/K quantized after llama.cpp's permutation."""
    from transformers import AutoModelForCausalLM

    d, model = write_tiny_model(tmp_path / "hf", "llama", seed=5)
    path = tmp_path / "q.gguf"
    stored = write_gguf(
        model,
        d,
        path,
        qtypes={
            "attn_q.weight": Q.Q8_0,
            "attn_k.weight": Q.Q4_1,
            "attn_v.weight": Q.F16,
            "attn_output.weight": Q.BF16,
            "ffn_gate.weight": Q.Q4_0,
            "ffn_up.weight": Q.Q4_1,
            "ffn_down.weight": Q.Q8_0,
            "token_embd.weight": Q.Q8_0,
        },
    )
    ref = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    ref.load_state_dict(stored, strict=False)
    # the quantization changed the weights: the reference is the dequantized model
    assert not torch.equal(
        ref.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight
    )
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, num_threads=1)
    prompts = _prompts(model.config.vocab_size)
    for p in prompts:
        torch.testing.assert_close(
            llm.engine.score(p, use_prefix_cache=False).logits,
            hf_logits(ref, p),
            atol=1e-4,
            rtol=1e-4,
        )
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, 8) for p in prompts]


def test_gguf_tokenizer_and_chat_template_match_tokenizer_json(tmp_path: Path) -> None:
    d, model = write_tiny_model(tmp_path / "hf", "llama", seed=1)
    path = tmp_path / "m.gguf"
    write_gguf(model, d, path)
    from_gguf = load_model(path, torch.float32, torch.device("cpu")).tokenizer
    from_dir = load_model(d, torch.float32, torch.device("cpu")).tokenizer
    raw = RawTokenizer.from_file(str(d / "tokenizer.json"))
    for text in TEXTS:
        expected = raw.encode(text).ids
        assert from_gguf.encode(text) == expected
        assert from_dir.encode(text) == expected
        assert from_gguf.decode(expected) == raw.decode(expected)
    msgs = [{"role": "user", "content": "hi"}]
    assert from_gguf.apply_chat_template(msgs) == from_dir.apply_chat_template(msgs)
    assert (
        from_gguf.apply_chat_template(msgs)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert from_gguf.eos_token_id == from_gguf.encode("<|im_end|>")[0]


def test_sharded_safetensors_load_like_a_single_file(tmp_path: Path) -> None:
    d1, _ = write_tiny_model(tmp_path / "one", "qwen2", seed=11)
    d2, _ = write_tiny_model(tmp_path / "sharded", "qwen2", seed=11, shard=True)
    assert (d2 / "model.safetensors.index.json").is_file()
    assert len(list(d2.glob("*.safetensors"))) > 1
    a = load_model(d1, torch.float32, torch.device("cpu"))
    b = load_model(d2, torch.float32, torch.device("cpu"))
    for (na, ta), (nb, tb) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert na == nb
        assert torch.equal(ta, tb)
    # the fingerprint covers tensors, not how they are split into files
    assert a.fingerprint == b.fingerprint
    assert a.model_id == "one"


def test_fingerprint_is_stable_and_tracks_weights(tmp_path: Path) -> None:
    d, model = write_tiny_model(tmp_path / "a", "llama", seed=2)
    fp1 = load_model(d, torch.float32, torch.device("cpu")).fingerprint
    fp2 = load_model(d, torch.bfloat16, torch.device("cpu")).fingerprint
    assert fp1 == fp2 and len(fp1) == 64 and int(fp1, 16) >= 0
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 0.5
    model.save_pretrained(d)
    assert load_model(d, torch.float32, torch.device("cpu")).fingerprint != fp1
    g1, g2 = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(model, d, g1)
    write_gguf(model, d, g2, qtypes={"ffn_up.weight": Q.Q8_0})
    f1 = load_model(g1, torch.float32, torch.device("cpu")).fingerprint
    assert f1 == load_model(g1, torch.float32, torch.device("cpu")).fingerprint
    assert f1 != load_model(g2, torch.float32, torch.device("cpu")).fingerprint


def test_bad_model_paths_raise_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope.gguf", torch.float32, torch.device("cpu"))
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError):
        load_model(junk, torch.float32, torch.device("cpu"))
    d, _ = write_tiny_model(tmp_path / "m", "llama", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineConfigError, match="unsupported model_type"):
        load_model(d, torch.float32, torch.device("cpu"))


def _spm_vocab() -> list[tuple[str, float, int]]:
    """A SentencePiece-BPE vocabulary (control, byte and normal pieces) trained on the corpus."""
    from tokenizers import Tokenizer as RawTok
    from tokenizers import models, pre_tokenizers, trainers

    raw = RawTok(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=420, show_progress=False)
    raw.train_from_iterator(_CORPUS, trainer=trainer)
    learned = sorted(raw.get_vocab().items(), key=lambda kv: kv[1])
    vocab = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    vocab += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    # a BPE piece learned later is a later merge: lower score
    vocab += [(piece, -float(rank), 1) for rank, (piece, _) in enumerate(learned)]
    return vocab


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.engine.tiny_models import hf_config, random_model

    vocab = _spm_vocab()
    model = random_model(hf_config("llama", len(vocab), bos_token_id=1, eos_token_id=2), seed=4)
    path = tmp_path / "spm.gguf"
    write_gguf(model, None, path, spm_vocab=vocab)
    ours = load_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = [*TEXTS[:4], "unseen wörds ☃ and\nnewlines", " leading space", "x"]
    for text in texts:
        expected = ref(text)["input_ids"]
        assert ours.encode(text) == expected, text
        assert expected[0] == 1  # BOS added, as llama.cpp does for SentencePiece
        assert ours.decode(expected) == ref.decode(expected, skip_special_tokens=True)
    # characters outside the vocabulary fall back to byte tokens, and round-trip
    ids = ours.encode("☃", add_special_tokens=False)
    assert all(vocab[i][2] == 6 for i in ids[1:]) and ours.decode(ids) == "☃"
    assert ours.token_bytes(ids[-1]) == "☃".encode()[-1:]


def test_known_model_names_resolve(smollm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLM("smollm2")`` loads the fetched file; an unknown name is a clear error."""
    monkeypatch.setenv("KVTIER_MODEL_DIR", str(smollm2.parent))
    loaded = load_model("smollm2", torch.float32, torch.device("cpu"), max_positions=64)
    assert loaded.model_id == smollm2.stem
    with pytest.raises(ModelLoadError, match="model not found"):
        load_model("no-such-model", torch.float32, torch.device("cpu"))
