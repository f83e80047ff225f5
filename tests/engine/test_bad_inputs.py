"""Bad inputs raise clear, typed errors naming what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.engine import (
    LLM,
    ConnectorError,
    EngineConfig,
    EngineConfigError,
    InvalidRequestError,
    SamplingParams,
)
from kvtier.engine.config import parse_bytes
from kvtier.engine.connector import make_connector


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop": "abc"}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"seed": -5}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs).validate(vocab_size=1000)
    assert e.value.field == field
    assert isinstance(e.value, ValueError)


def test_valid_sampling_params_pass() -> None:
    SamplingParams().validate()
    SamplingParams(temperature=0, top_k=5, top_p=0.5, stop=["\n"], seed=3, logprobs=0).validate(10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "float16"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"block_size": 12}, "block_size"),
        ({"block_size": 0}, "block_size"),
        ({"kv_cache_memory": "lots"}, "byte size"),
        ({"kv_cache_memory": 0}, "positive"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"num_threads": 0}, "num_threads"),
        ({"seed": -1}, "seed"),
        ({"kv_connector": ""}, "kv_connector"),
    ],
)
def test_engine_config_is_validated_when_built(kwargs: dict, match: str) -> None:
    with pytest.raises(EngineConfigError, match=match):
        EngineConfig(model="m.gguf", **kwargs)


def test_byte_sizes() -> None:
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1.5 KiB") == 1536
    assert parse_bytes(4096) == 4096
    assert EngineConfig(model="m.gguf", kv_cache_memory="1GiB").kv_cache_memory == 2**30


def test_unknown_connector_is_a_clear_error() -> None:
    with pytest.raises(ConnectorError, match="unknown kv connector 'nope'"):
        make_connector("nope")
    with pytest.raises(ConnectorError, match="cannot import"):
        make_connector("no_such_module_xyz:Thing")
    with pytest.raises(ConnectorError, match="not a KVConnector"):
        make_connector("kvtier.engine.config:EngineConfig")


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu", max_model_len=64, num_threads=1)


def test_prompt_and_length_limits(llm: LLM) -> None:
    engine = llm.engine
    assert engine.max_model_len == 64
    with pytest.raises(InvalidRequestError, match="at most 63 fit") as e:
        engine.add_request([5] * 64, SamplingParams(max_tokens=1))
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequestError, match="lower max_tokens to at most 14") as e:
        engine.add_request([5] * 50, SamplingParams(max_tokens=15))
    assert e.value.field == "max_tokens"
    engine.add_request([5] * 50, SamplingParams(max_tokens=14))  # exactly fits
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([1, 10**6])
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([1, "2"])  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError, match="string or a list"):
        engine.add_request(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        engine.add_request([1], {"max_tokens": 3})  # type: ignore[arg-type]
    while engine.has_unfinished():
        engine.step()


def test_duplicate_request_id_and_abort(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=5), request_id="dup")
    with pytest.raises(InvalidRequestError, match="already in use") as e:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=5), request_id="dup")
    assert e.value.field == "request_id"
    out = engine.abort("dup")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.abort("dup") is None
    assert not engine.has_unfinished()
    assert engine.stats().kv_blocks_used == 0


def test_bad_chat_messages(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    with pytest.raises(InvalidRequestError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(InvalidRequestError, match="role"):
        tok.apply_chat_template([{"content": "hi"}])
    with pytest.raises(InvalidRequestError, match="content"):
        tok.apply_chat_template([{"role": "user", "content": 5}])
    with pytest.raises(InvalidRequestError):
        llm.chat([])


def test_generate_rejects_mismatched_params_without_running_anything(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2], [10**7]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_chat_templates_are_sandboxed_and_can_reject() -> None:
    from kvtier.engine.chat_template import ChatTemplate

    msgs = [{"role": "user", "content": "hi"}]
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        evil.render(msgs, add_generation_prompt=True, bos_token="", eos_token="")
    strict = ChatTemplate(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}ok"
    )
    with pytest.raises(InvalidRequestError, match="system first"):
        strict.render(msgs, add_generation_prompt=True, bos_token="", eos_token="")
    sys_msgs = [{"role": "system", "content": "x"}]
    assert strict.render(sys_msgs, add_generation_prompt=True, bos_token="", eos_token="") == "ok"
