"""Files below a root someone else controls: no link is ever followed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nbfleet.storage import beneath

pytestmark = pytest.mark.no_db


@pytest.fixture
def slot(tmp_path: Path) -> tuple[Path, Path]:
    root, outside = tmp_path / "slot", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    return root, outside


def test_writes_and_deletes_never_go_through_a_planted_link(slot: tuple[Path, Path]) -> None:
    root, outside = slot
    (root / "d").symlink_to(outside)
    with pytest.raises(OSError):
        beneath.write(str(root), "d/secret.txt", b"overwritten")
    beneath.unlink(str(root), "d/secret.txt")
    assert (outside / "secret.txt").read_text() == "secret"
    (root / "f").symlink_to(outside / "secret.txt")
    beneath.write(str(root), "f", b"mine")  # replaces the link itself
    assert (outside / "secret.txt").read_text() == "secret"
    assert not (root / "f").is_symlink() and (root / "f").read_bytes() == b"mine"


def test_reads_skip_links_and_special_files(slot: tuple[Path, Path]) -> None:
    root, outside = slot
    (root / "a.txt").write_text("a")
    (root / "link.txt").symlink_to(outside / "secret.txt")
    (root / "dir").symlink_to(outside)
    os.mkfifo(root / "fifo")
    seen = {}
    for relative, dir_fd, name in beneath.files(str(root)):
        with beneath.open_regular(dir_fd, name) as opened:
            if opened is not None:
                seen[relative] = beneath.read_fd(opened[0], 100)
    assert seen == {"a.txt": b"a"}


def test_reads_are_bounded(slot: tuple[Path, Path]) -> None:
    root, _ = slot
    (root / "big").write_bytes(b"x" * 1000)
    with beneath.directory(str(root)) as fd, beneath.open_regular(fd, "big") as opened:
        assert opened is not None
        assert beneath.read_fd(opened[0], 999) is None
    with beneath.directory(str(root)) as fd, beneath.open_regular(fd, "big") as opened:
        assert opened is not None
        assert beneath.read_fd(opened[0], 1000) == b"x" * 1000


def test_ownership_is_handed_over_without_following_links(slot: tuple[Path, Path]) -> None:
    root, outside = slot
    if os.geteuid() != 0:
        pytest.skip("changing owners needs root")
    (root / "sub").mkdir()
    (root / "sub" / "f").write_text("f")
    (root / "sub" / "out").symlink_to(outside / "secret.txt")
    beneath.chown_tree(str(root), (4242, 4242))
    assert (root / "sub" / "f").stat().st_uid == 4242
    assert os.lstat(root / "sub" / "out").st_uid == 4242
    assert (outside / "secret.txt").stat().st_uid == 0
