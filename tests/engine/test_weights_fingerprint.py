"""The weights fingerprint: every byte hashed, once per file version, cached under $HOME."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.engine.models.fingerprint import (
    FingerprintCache,
    RawTensor,
    default_cache_path,
    weights_fingerprint,
)
from kvtier.engine.models.gguf_loader import GGUFFile
from kvtier.engine.models.hf_loader import HFModelDir
from tests.engine.gguf_files import write_gguf
from tests.engine.tiny_models import write_tiny_model


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private $HOME: the fingerprint cache lands in it, not in the user's."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


class Reader:
    """Reads one safetensors file's tensors, counting how often it is asked to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls = 0

    def __call__(self) -> Iterator[RawTensor]:
        self.calls += 1
        for name, t in load_file(self.path).items():
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
            yield name, str(t.dtype), tuple(t.shape), raw


def write(path: Path, big: torch.Tensor) -> None:
    save_file({"big": big, "small": torch.arange(8, dtype=torch.float32)}, str(path))


def big_tensor() -> torch.Tensor:
    return torch.randn(1024, 256, generator=torch.Generator().manual_seed(0))  # 1 MiB


def test_one_changed_row_of_one_tensor_changes_the_fingerprint(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    big = big_tensor()
    write(a, big)
    changed = big.clone()
    # NOTE: row 517 (bytes [529408, 530432)) falls between the 256-byte windows
    # the sampled fingerprint read (every ~16.6 KB of a 1 MiB tensor): it missed this.
    changed[517, 3] += 1.0
    write(b, changed)
    fa = weights_fingerprint([a], Reader(a)).digest
    fb = weights_fingerprint([b], Reader(b)).digest
    assert fa != fb and len(fa) == 64
    write(b, big)  # the same tensors in another file: the same fingerprint
    assert weights_fingerprint([b], Reader(b)).digest == fa


def test_a_tiny_models_fingerprint_follows_one_row(tmp_path: Path) -> None:
    d, _ = write_tiny_model(tmp_path / "m", "llama", seed=3)
    before = HFModelDir(d).fingerprint()
    (weights,) = d.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"][5] += 0.25
    save_file(tensors, str(weights), metadata={"format": "pt"})
    after = HFModelDir(d).fingerprint()
    assert after != before


def test_the_second_call_is_answered_by_the_cache_in_home(
    tmp_path: Path, home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "w.safetensors"
    write(path, big_tensor())
    reader = Reader(path)
    with caplog.at_level(logging.INFO, logger="kvtier.engine.models.fingerprint"):
        first = weights_fingerprint([path], reader, label="w")
    assert reader.calls == 1 and not first.cached
    assert first.nbytes == 1024 * 256 * 4 + 8 * 4
    assert first.hash_seconds > 0
    assert any(
        "weights fingerprint of w" in r.message and "hashed in" in r.message for r in caplog.records
    )
    assert default_cache_path() == home / ".cache" / "kvtier" / "fingerprints.json"
    assert default_cache_path().is_file()
    second = weights_fingerprint([path], reader)
    assert reader.calls == 1  # nothing read again
    assert second.cached and second.digest == first.digest
    assert second.hash_seconds == pytest.approx(first.hash_seconds)  # what hashing cost, recorded


def test_a_changed_file_is_hashed_again(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    big = big_tensor()
    write(path, big)
    reader = Reader(path)
    first = weights_fingerprint([path], reader).digest
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # mtime alone
    assert weights_fingerprint([path], reader).digest == first
    assert reader.calls == 2
    write(path, big[:512])  # another size
    assert weights_fingerprint([path], reader).digest != first
    assert reader.calls == 3
    # same size, mtime put back: still noticed (ctime and inode are part of the identity)
    st = path.stat()
    changed = big[:512].clone()
    changed[0, 0] += 1
    write(path, changed)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
    assert weights_fingerprint([path], reader).digest != first
    assert reader.calls == 4


def test_an_unreadable_cache_is_started_afresh(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    write(path, big_tensor())
    cache = FingerprintCache(tmp_path / "cache.json")
    cache.path.write_text("{ not json")
    reader = Reader(path)
    fp = weights_fingerprint([path], reader, cache=cache)
    assert json.loads(cache.path.read_text())  # rewritten, valid
    assert weights_fingerprint([path], reader, cache=cache) == fp.__class__(
        fp.digest, fp.nbytes, fp.hash_seconds, cached=True
    )
    assert reader.calls == 1


def test_the_cache_keeps_a_bounded_number_of_entries(tmp_path: Path) -> None:
    cache = FingerprintCache(tmp_path / "cache.json", max_entries=3)
    paths = []
    for i in range(5):
        p = tmp_path / f"w{i}.safetensors"
        write(p, big_tensor()[: 8 + i])
        paths.append(p)
        weights_fingerprint([p], Reader(p), cache=cache)
    assert len(json.loads(cache.path.read_text())) == 3
    reader = Reader(paths[-1])
    weights_fingerprint([paths[-1]], reader, cache=cache)
    assert reader.calls == 0  # the newest is still there


def test_a_gguf_file_is_fingerprinted_once(tmp_path: Path) -> None:
    d, model = write_tiny_model(tmp_path / "m", "llama", seed=4)
    path = tmp_path / "m.gguf"
    write_gguf(model, d, path)
    first = GGUFFile(path)
    digest = first.fingerprint()
    assert first.fingerprint_info is not None and not first.fingerprint_info.cached
    again = GGUFFile(path)
    assert again.fingerprint() == digest
    assert again.fingerprint_info is not None and again.fingerprint_info.cached
