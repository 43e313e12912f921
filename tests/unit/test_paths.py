"""confine(): the one gate every workspace-relative path passes through."""

from __future__ import annotations

import os

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from nbfleet.model.errors import InvalidInput
from nbfleet.storage.paths import MAX_PATH_LENGTH, MAX_SEGMENT_BYTES, confine


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "..",
        ".",
        "../x",
        "a/..",
        "a/../../b",
        "a/../b",
        "/etc/passwd",
        "/",
        "a//b",
        "a/",
        "./a",
        "a/./b",
        "a\\b",
        "..\\..\\windows",
        "C:\\Windows",
        "a\x00b",
        "a\nb",
        "tab\there",
        "esc\x1b",
        "del\x7f",
        "x" * (MAX_PATH_LENGTH + 1),
        "x" * (MAX_SEGMENT_BYTES + 1),
        "dir/" + "x" * (MAX_SEGMENT_BYTES + 1) + "/f.txt",
        "é" * 128,  # 256 bytes in UTF-8, though 128 characters
        "lone \udc80 surrogate",
    ],
)
def test_refuses(raw: str) -> None:
    with pytest.raises(InvalidInput) as info:
        confine(raw)
    assert info.value.status == 422


@pytest.mark.parametrize(
    "raw",
    [
        "a.ipynb",
        "dir/sub/file.txt",
        "...",
        ".hidden",
        "a..b/c..",
        "with space/and-dash_underscore.py",
        "données/résumé.ipynb",
        "日本語/ノート.ipynb",
        "party 🎉.txt",
        # Exactly MAX_PATH_LENGTH characters, in segments of at most 255 bytes.
        "/".join(["x" * MAX_SEGMENT_BYTES] * 3 + ["x" * (MAX_SEGMENT_BYTES - 1), "y"]),
        "é" * 127,  # 254 bytes
        # Only a leading "/" is absolute on POSIX; a colon is an ordinary character.
        "a:b",
        "c:x",
        "C:/Windows",
        "notes/12:30 meeting.txt",
    ],
)
def test_accepts_and_returns_unchanged(raw: str) -> None:
    assert len(raw) <= MAX_PATH_LENGTH
    assert confine(raw) == raw


def test_long_segment_error_says_why() -> None:
    with pytest.raises(InvalidInput, match="at most 255 bytes"):
        confine("ok/" + "ü" * 200)


def test_error_carries_the_path() -> None:
    with pytest.raises(InvalidInput) as info:
        confine("../secret")
    assert info.value.extra["path"] == "../secret"


segment = st.one_of(
    st.sampled_from(["", ".", "..", "...", "a", "b.ipynb", "\\", "..\\x", "c:"]),
    st.text(min_size=1, max_size=6),
)
raw_paths = st.builds(
    lambda lead, parts: lead + "/".join(parts),
    st.sampled_from(["", "", "/", "./", "../"]),
    st.lists(segment, min_size=1, max_size=6),
)


@given(raw=st.one_of(raw_paths, st.text(max_size=40)))
@example(raw="a/../../b")
@example(raw="a/b/../../..")
def test_accepted_paths_stay_inside_root(raw: str) -> None:
    root = os.path.join(os.sep, "srv", "root")
    try:
        clean = confine(raw)
    except InvalidInput:
        return  # refusing is always safe; only other exceptions would fail here
    joined = os.path.normpath(os.path.join(root, clean))
    assert joined.startswith(root + os.sep)
    assert os.path.commonpath([root, joined]) == root
    # Normalizing changes nothing: no '.', '..' or empty segments slipped through.
    assert joined == os.path.join(root, *clean.split("/"))
    assert confine(clean) == clean
