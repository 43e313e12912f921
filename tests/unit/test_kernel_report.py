"""A restore report that is never wrong: a name is "restored" only if its value was
checked equal to the one saved; anything else is "changed" or lost, with the reason,
in the report the agent passes on and in the notebook's resume message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbfleet.agent import restore_report
from nbfleet.kernel import codec, shape, verify
from tests.support.kernel_shell import Session, shell

DRIFTS = ("class Drifts:\n"
          "    def __init__(self):\n        self.n = 1\n"
          "    def __setstate__(self, state):\n"
          "        self.__dict__.update(state)\n        self.n += 1\n"
          "d = Drifts()\nholder = [d]")


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    kernel = Session(shell(), tmp_path / "state")
    yield kernel
    kernel.close()


def agent_view(report: dict[str, Any]) -> dict[str, Any]:
    """What the agent makes of the kernel's report (the agent's own code)."""
    return {"path": "warm", "files_only": False, "error": None,
            **restore_report.clean_report(json.loads(json.dumps(report)))}


def test_a_value_that_comes_back_different_is_not_called_restored(session: Session) -> None:
    session.cell(DRIFTS)
    session.cell("other = {'k': 1}")
    session.suspend()
    report = session.resume()
    assert session.ns["d"].n == 2  # __setstate__ changed it on the way back
    assert "d" not in report["restored"] and "other" in report["restored"]
    assert set(report["changed"]) == {"d", "holder"}  # holder holds d: one graph
    changed = {item["name"]: item for item in report["lost"]}
    assert changed["d"]["status"] == "changed" and changed["d"]["type"] == "__main__.Drifts"
    assert changed["d"]["reason"].startswith(verify.DIFFERS)
    assert "shares objects with d" in changed["holder"]["reason"]
    written = json.loads((session.state_dir / "restore-report.json").read_text())
    assert written["changed"] == report["changed"]
    view = agent_view(report)
    assert "d" not in view["restored"] and "d" not in {item["name"] for item in view["lost"]}
    assert {item["name"] for item in view["changed"]} == {"d", "holder"}
    message = restore_report.describe(view)
    assert f"Changed: d (__main__.Drifts): {verify.DIFFERS}" in message
    assert "it is loaded as it came back" in message and "2 came back changed" in message
    assert "Not restored: d" not in message


def test_a_changed_value_is_saved_again_at_the_next_suspend(session: Session) -> None:
    session.cell(DRIFTS)
    session.suspend()
    session.resume()
    session.suspend()  # the value as it is now, n == 2
    report = session.resume()
    assert report["changed"] == ["d", "holder"]  # it drifts again: the check says so
    assert session.ns["d"].n == 3


def test_equal_values_are_restored_even_when_their_pickle_differs() -> None:
    """A set iterates in insertion order among colliding hashes (and in another
    order under another hash seed): its shape still proves it equal."""
    ns: dict[str, Any] = {}
    saved, restored = {1, 9}, set([9, 1])
    assert list(saved) != list(restored)
    encoded = codec.encode_group([saved], ns, None)
    info = {"digest": encoded.digests[0], "shape": shape.shape(saved, ns)}
    assert verify.check(["s"], [restored], [info], "cloudpickle", ns) == {}
    without_shape = verify.check(["s"], [restored], [{"digest": encoded.digests[0]}],
                                 "cloudpickle", ns)
    assert without_shape["s"].startswith(verify.DIFFERS)
    assert verify.check(["s"], [{1, 10}], [info], "cloudpickle", ns)  # unequal: never passes


def test_shapes_tell_values_apart() -> None:
    ns: dict[str, Any] = {}
    import numpy as np

    same = [([1, {"a": 2.0}], [1, {"a": 2.0}]), ("x", "x"), (np.arange(3), np.arange(3)),
            (np.zeros(2_000_000), np.zeros(2_000_000))]
    for left, right in same:
        assert shape.shape(left, ns) == shape.shape(right, ns)
    shared = [1]
    different = [([1, 2], [2, 1]), ([shared, shared], [[1], [1]]), (1, 1.0), (1, True),
                 (np.arange(3), np.arange(3.0)), ({"a": 1}, {"a": 2}), (-0.0, 0.0)]
    for left, right in different:
        assert shape.shape(left, ns) != shape.shape(right, ns), (left, right)
    assert shape.shape(list(range(10)), ns, limit=5) is None


def test_a_snapshot_without_digests_still_restores(session: Session) -> None:
    """Snapshots written before digests existed: nothing to compare, as before."""
    session.cell("x = [1, 2]")
    session.suspend()
    path = session.state_dir / "manifest.json"
    doc = json.loads(path.read_text())
    for entry in doc["values"].values():
        entry.pop("digest", None)
        entry.pop("shape", None)
    path.write_text(json.dumps(doc))
    report = session.resume()
    assert report["restored"] == ["x"] and report["changed"] == []


def test_a_group_that_cannot_be_loaded_is_lost_with_a_reason(session: Session) -> None:
    session.cell("import numpy as np\nbig = np.ones(100_000)\nview = big[:5]\nsmall = 1")
    session.suspend()
    doc = json.loads((session.state_dir / "manifest.json").read_text())
    [group] = doc["groups"]
    (session.state_dir / "blobs" / group["buffers"][0]["blob"]).unlink()
    report = session.resume()
    lost = {item["name"]: item for item in report["lost"]}
    assert set(lost) == {"big", "view"} and "could not be loaded" in lost["big"]["reason"]
    assert "small" in report["restored"] and "big" not in session.ns
