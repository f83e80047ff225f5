from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli import main
from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, dump_config, load_config
from kvtier.errors import ConfigError
from kvtier.factory import build_store
from kvtier.units import parse_bytes


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "kvtier.yaml"
    p.write_text(text)
    return p


def test_defaults_are_cpu_then_disk() -> None:
    cfg = load_config(env={})
    assert [type(t) for t in cfg.tiers] == [CpuTierConfig, DiskTierConfig]
    assert cfg.chunk_size == 256 and cfg.block.compression == "none"


def test_file_with_units_and_policies(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        """
chunk_size: 512
store: {write_policy: selective, selective_hits: 3}
tiers:
  - {type: cpu, capacity: 64MiB, eviction: lfu}
  - {type: disk, path: /tmp/x, capacity: 2 GB}
""",
    )
    cfg = load_config(p, env={})
    assert cfg.chunk_size == 512
    assert cfg.tiers[0].capacity == 64 * 2**20 and cfg.tiers[0].eviction == "lfu"
    assert cfg.tiers[1].capacity == 2 * 10**9
    assert cfg.store.write_policy == "selective" and cfg.store.selective_hits == 3


@pytest.mark.parametrize(
    "text,needle",
    [
        ("chunk_sise: 256", "chunk_sise: unknown key"),
        ("tiers: [{type: cpu, capacity: 4XB}]", "tiers.0.cpu.capacity: unknown unit 'XB'"),
        ("tiers: [{type: cpu, capacity: -5}]", "tiers.0.cpu.capacity"),
        ("tiers: [{type: tape}]", "tiers.0"),
        ("tiers: []", "tiers"),
        ("chunk_size: 100", "multiple of 16"),
        ("store: {write_policy: sometimes}", "store.write_policy"),
        ("tiers: [{type: cpu}, {type: cpu}]", "unique"),
        ("- just\n- a list", "mapping"),
        ("chunk_size: [", "not valid YAML"),
    ],
)
def test_bad_files_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), env={})
    assert needle in str(e.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml", env={})


def test_environment_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, "tiers: [{type: cpu, capacity: 1GiB}]")
    cfg = load_config(
        p,
        env={
            "KVTIER_TIERS__0__CAPACITY": "2GiB",
            "KVTIER_STORE__WRITE_POLICY": "write_back",
            "KVTIER_CHUNK_SIZE": "512",
        },
    )
    assert cfg.tiers[0].capacity == 2 * 2**30
    assert cfg.store.write_policy == "write_back" and cfg.chunk_size == 512
    # Without a file, list overrides apply to the default tiers.
    assert load_config(env={"KVTIER_TIERS__1__CAPACITY": "3GiB"}).tiers[1].capacity == 3 * 2**30
    # Variables that are not config keys are left alone.
    assert (
        load_config(
            env={"KVTIER_MODEL_DIR": "/x", "KVTIER_SOMETHING_ELSE_ENTIRELY": "1"}
        ).chunk_size
        == 256
    )


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"KVTIER_CHUNKSIZE": "1"}, "did you mean KVTIER_CHUNK_SIZE"),
        ({"KVTIER_STORE__NOPE": "1"}, "store.nope: unknown key"),
        ({"KVTIER_TIERS__7__CAPACITY": "1GiB"}, "no list item"),
        ({"KVTIER_CHUNK_SIZE": "big"}, "chunk_size"),
    ],
)
def test_bad_environment_overrides(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(env=env)
    assert needle in str(e.value)


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(env={"KVTIER_CHUNK_SIZE": "1024"})
    again = load_config(write(tmp_path, dump_config(cfg)), env={})
    assert again == cfg


def test_build_store_from_config(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        f"tiers: [{{type: cpu, capacity: 1MiB}}, {{type: disk, path: {tmp_path}/d, capacity: 4MiB}}]",
    )
    with build_store(load_config(p, env={})) as store:
        assert [t.name for t in store.tiers] == ["cpu", "disk"]
        assert store.usage()["disk"].capacity_bytes == parse_bytes("4MiB")


def test_cli_config_show_and_validate(tmp_path: Path) -> None:
    runner = CliRunner()
    good = write(tmp_path, "chunk_size: 512")
    r = runner.invoke(main, ["config", "show", "--config", str(good)])
    assert r.exit_code == 0 and "chunk_size: 512" in r.output
    r = runner.invoke(main, ["config", "validate", str(good)])
    assert r.exit_code == 0 and "valid" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [{type: cpu, capacity: lots}]")
    r = runner.invoke(main, ["config", "validate", str(bad)])
    assert r.exit_code == 1 and "tiers.0.cpu.capacity" in r.output
    r = runner.invoke(main, ["config", "show", "--config", str(bad)])
    assert r.exit_code != 0 and "tiers.0.cpu.capacity" in r.output


def test_cli_help_at_every_level() -> None:
    runner = CliRunner()
    for args in (
        ["--help"],
        ["config", "--help"],
        ["config", "show", "--help"],
        ["demo", "--help"],
    ):
        r = runner.invoke(main, args)
        assert r.exit_code == 0, (args, r.output)
        assert "Usage:" in r.output
    assert "demo" in runner.invoke(main, ["--help"]).output


def test_parse_bytes() -> None:
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("1.5 KiB") == 1536
    assert parse_bytes("10MB") == 10**7
    assert parse_bytes(7) == 7
    for bad in ("", "abc", "-1GiB", "5 parsecs", True):
        with pytest.raises(ValueError):
            parse_bytes(bad)  # type: ignore[arg-type]


def test_block_tokens_is_read_as_page_tokens() -> None:
    """The key granularity was renamed (issue 18); files that still say block_tokens load."""
    assert KvtierConfig.model_validate({"block_tokens": 32}).page_tokens == 32
    assert KvtierConfig().page_tokens == 16
