"""The disk tier keeps KV private: directories 0700, block files 0600, whatever the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_files import is_shared_dir
from tests.kvtier.helpers import block, key


def test_directories_are_0700_and_files_0600_even_with_a_permissive_umask(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "cache"
    old = os.umask(0o002)  # what many desktops use: new files group-writable, world-readable
    try:
        tier = DiskTier(root, 64 << 20)
        tier.put([(key(i), block(i)) for i in range(4)])
        tier.close()
    finally:
        os.umask(old)
    dirs = [tmp_path / "a", tmp_path / "a" / "b", *[p for p in root.rglob("*") if p.is_dir()]]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) == 4
    for d in [root, *dirs]:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert not is_shared_dir(root)


def test_an_existing_shared_directory_is_left_as_it_is_and_recognised(tmp_path: Path) -> None:
    root = tmp_path / "team"
    root.mkdir()
    os.chmod(root, 0o770)  # shared with a group on purpose
    tier = DiskTier(root, 64 << 20)
    tier.put([(key(1), block(1))])
    tier.close()
    assert stat.S_IMODE(root.stat().st_mode) == 0o770
    assert is_shared_dir(root)
    (f,) = [p for p in root.rglob("*.kvb")]
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
