"""The vLLM connector's configuration: versions, failure policy, extra config, model and namespace.

No vLLM needed: vLLM's config objects are stood in for by the attributes
``model_from_vllm`` reads.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig
from kvtier.connectors.vllm_config import (
    TESTED_VLLM_VERSIONS,
    VllmModel,
    VllmSettings,
    check_failure_policy,
    check_vllm_version,
    model_from_vllm,
    namespace_for,
    resolve_model_dir,
)
from kvtier.errors import ConfigError
from kvtier.tiers.remote_config import RemoteTierConfig


def test_untested_vllm_versions_are_refused_unless_allowed(caplog) -> None:
    check_vllm_version(TESTED_VLLM_VERSIONS[0], allow_untested=False)
    with pytest.raises(
        ConfigError, match=r"tested with vLLM 0\.32\.0, not 0\.33\.0.*allow_untested"
    ):
        check_vllm_version("0.33.0", allow_untested=False)
    check_vllm_version("0.33.0", allow_untested=True)
    assert "starting anyway" in caplog.text


def test_only_the_recompute_failure_policy_is_accepted() -> None:
    check_failure_policy("recompute")
    with pytest.raises(ConfigError, match='"kv_load_failure_policy": "recompute"'):
        check_failure_policy("fail")


def test_extra_config_is_strict_and_picks_the_load_mode() -> None:
    s = VllmSettings.parse({"config": "kvtier.yaml", "load_mode": "auto"})
    assert s.config == "kvtier.yaml"
    with pytest.raises(ConfigError, match="confg: unknown key"):
        VllmSettings.parse({"confg": "kvtier.yaml"})
    with pytest.raises(ConfigError, match="load_mode"):
        VllmSettings.parse({"load_mode": "later"})
    local = KvtierConfig(tiers=[CpuTierConfig(), DiskTierConfig()])
    remote = KvtierConfig(tiers=[DiskTierConfig(), RemoteTierConfig(address="h:1")])
    assert not VllmSettings.parse({}).loads_async(local)
    assert VllmSettings.parse({}).loads_async(remote)
    assert not VllmSettings.parse({"load_mode": "sync"}).loads_async(remote)
    assert VllmSettings.parse({"load_mode": "async"}).loads_async(local)


def _vllm_config(model: Path, **overrides: object) -> SimpleNamespace:
    mc = SimpleNamespace(
        model=str(model),
        revision=None,
        use_mla=False,
        dtype=torch.bfloat16,
        get_num_layers=lambda pc: 30,
        get_num_kv_heads=lambda pc: 3,
        get_head_size=lambda: 64,
    )
    pc = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    cc = SimpleNamespace(block_size=128, cache_dtype="auto")
    for key, value in overrides.items():
        owner, name = key.split("__")
        setattr({"mc": mc, "pc": pc, "cc": cc}[owner], name, value)
    return SimpleNamespace(model_config=mc, parallel_config=pc, cache_config=cc)


def test_the_model_and_kv_geometry_come_from_vllms_config(tmp_path: Path) -> None:
    model = tmp_path / "SmolLM2-hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    got = model_from_vllm(_vllm_config(model))
    assert got == VllmModel(model.resolve(), "SmolLM2-hf", 30, 3, 64, "bfloat16", 128)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        model_from_vllm(_vllm_config(model, pc__tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="--kv-cache-dtype auto"):
        model_from_vllm(_vllm_config(model, cc__cache_dtype="fp8"))
    with pytest.raises(ConfigError, match="MLA"):
        model_from_vllm(_vllm_config(model, mc__use_mla=True))


def test_a_model_that_is_not_on_local_disk_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="on local disk"):
        resolve_model_dir(str(tmp_path / "nowhere"))


def test_the_namespace_ignores_vllms_block_size_and_changes_with_the_weights() -> None:
    cfg = KvtierConfig()
    a = VllmModel(Path("/m"), "m", 30, 3, 64, "bfloat16", 128)
    b = VllmModel(Path("/m"), "m", 30, 3, 64, "bfloat16", 16)
    assert namespace_for(a, cfg, "fp").root_key() == namespace_for(b, cfg, "fp").root_key()
    assert namespace_for(a, cfg, "fp").root_key() != namespace_for(a, cfg, "fp2").root_key()
    f32 = VllmModel(Path("/m"), "m", 30, 3, 64, "float32", 128)
    assert namespace_for(a, cfg, "fp").root_key() != namespace_for(f32, cfg, "fp").root_key()
