"""The runtime's copy of workspace files: written atomically under any name the
API accepts, and the agent's half-written files never synced back."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbfleet.agent import filesync


@pytest.mark.no_db
def test_the_longest_names_the_api_accepts_are_written(tmp_path: Path) -> None:
    name = "n" * 255  # the API's limit per segment; "<name>.tmp" would pass it
    stamp = filesync.write_local(str(tmp_path), f"dir/{name}", b"data")
    assert (tmp_path / "dir" / name).read_bytes() == b"data"
    assert stamp[0] == 4
    assert [p.name for p in (tmp_path / "dir").iterdir()] == [name]  # no temporary left


@pytest.mark.no_db
def test_half_written_files_are_not_synced_back(tmp_path: Path) -> None:
    (tmp_path / "kept.txt").write_text("k")
    (tmp_path / f"{filesync.TMP_PREFIX}abc").write_text("partial")
    assert set(filesync.scan(str(tmp_path))) == {"kept.txt"}
