"""nbfleet.kernel inside real ipykernels: capture, flush, restore into a fresh kernel."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.real_kernel import FLUSH, RESTORE, Kernel, copy_snapshot

#: Runs no DB: the PostgreSQL pass of `make test` skips it.
pytestmark = [pytest.mark.no_db, pytest.mark.timeout(180)]

@pytest.fixture
def start_kernel(tmp_path: Path) -> Iterator[Callable[[str], Kernel]]:
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "data.txt").write_text("first line\nsecond line\n")
    kernels: list[Kernel] = []

    def start(name: str) -> Kernel:
        kernel = Kernel(tmp_path / f"state-{name}", workdir, preimport="numpy, no_such_module_xyz")
        kernels.append(kernel)
        return kernel

    yield start
    for kernel in kernels:
        kernel.stop()


def blob_stats(state_dir: Path) -> dict[str, tuple[int, int]]:
    return {path.name: (path.stat().st_ino, path.stat().st_mtime_ns)
            for path in (state_dir / "blobs").iterdir()}


CELLS_A = [
    "import numpy as np\nimport pandas as pd\nimport threading\nfrom os import path as osp",
    "arr = np.random.default_rng(0).random(640_000)",  # 5 MB
    "rng = np.random.default_rng(1)\n"
    "df = pd.DataFrame({'n': np.arange(20_000), 'x': rng.random(20_000),"
    " 's': [f'row{i}' for i in range(20_000)]})",
    "config = {'lr': 0.1, 'layers': [64, 32]}\nnames = ['a', 'b']\ncount = 7\nratio = 0.25\n"
    "label = 'run-1'",
    "arr[:10] = 0\nconfig['layers'].append(16)",
    "factor = 3\ndef scale(v):\n    return v * factor",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
    "    def norm2(self):\n        return self.x ** 2 + self.y ** 2\np = Point(3, 4)",
    "fh = open('data.txt')",
    "lock = threading.Lock()",
    "gen = (i * i for i in range(5))",
    "side = (i for i in range(3))\nnames.append('c')",  # also mutates another name: lost
    "%time magic_gen = (i for i in range(3))",  # uses a magic: lost
]


def test_state_round_trips_into_a_fresh_kernel(start_kernel: Callable[[str], Kernel]) -> None:
    a = start_kernel("a")
    for code in CELLS_A:
        a.cell(code)
    reply, _, _ = a.execute("bad_gen = (i for i in range(2))\nraise RuntimeError('boom')")
    assert reply["status"] == "error"
    summary = a.call(FLUSH)

    doc = json.loads((a.state_dir / "manifest.json").read_text())
    assert doc["format"] == 1
    assert doc["imports"] == ["import numpy as np", "import pandas as pd", "import threading",
                              "from os import path as osp"]
    assert set(doc["recipes"]) == {"fh", "lock", "gen"}
    assert set(doc["lost"]) == {"side", "magic_gen", "bad_gen"} == set(summary["lost"])
    assert doc["values"]["arr"]["type"] == "numpy.ndarray"
    assert doc["values"]["arr"]["buffers"][0].keys() == {"blob"}
    assert doc["footprints"]["scale"] == ["factor"]
    assert sorted(doc["blobs"]) == doc["blobs"] == summary["blobs"]
    assert {p.name for p in (a.state_dir / "blobs").iterdir()} == set(doc["blobs"])
    assert summary["bytes"] > 5_000_000

    b = start_kernel("b")
    # The warm-up import happened, but bound no user name.
    assert b.value("['numpy' in __import__('sys').modules, 'numpy' in globals()]") == [True, False]
    copy_snapshot(a.state_dir, b.state_dir)
    report = b.call(RESTORE)
    assert report == json.loads((b.state_dir / "restore-report.json").read_text())
    restored = {"np", "pd", "threading", "osp", "arr", "rng", "df", "config", "names", "count",
                "ratio", "label", "factor", "scale", "Point", "p"}
    assert set(report["restored"]) == restored
    assert report["recomputed"] == ["fh", "gen", "lock"]
    lost = {item["name"]: item for item in report["lost"]}
    assert set(lost) == {"side", "magic_gen", "bad_gen"}
    assert {item["type"] for item in lost.values()} == {"builtins.generator"}
    assert "names" in lost["side"]["reason"]
    assert "magic" in lost["magic_gen"]["reason"]
    assert "raised" in lost["bad_gen"]["reason"]
    assert report["imports"] == doc["imports"]
    assert report["bytes"] > 5_000_000

    checks = {
        "arr": "np.array_equal(arr, np.concatenate([np.zeros(10),"
               " np.random.default_rng(0).random(640_000)[10:]]))",
        "arr writable": "arr.flags.writeable",
        "df": "df.equals(pd.DataFrame({'n': np.arange(20_000),"
              " 'x': np.random.default_rng(1).random(20_000),"
              " 's': [f'row{i}' for i in range(20_000)]}))",
        "rng continues": "rng.random() == np.random.default_rng(1).random(20_001)[-1]",
        "scalars": "(config, names, count, ratio, label) == ({'lr': 0.1, 'layers': [64, 32, 16]},"
                   " ['a', 'b', 'c'], 7, 0.25, 'run-1')",
        "modules": "(np.__name__, pd.__name__, osp is __import__('os').path)"
                   " == ('numpy', 'pandas', True)",
        "function": "scale(2) == 6",
        "class": "isinstance(p, Point) and p.norm2() == 25 and Point(1, 1).norm2() == 2",
        "file recomputed": "fh.read() == 'first line\\nsecond line\\n'",
        "lock recomputed": "type(lock) is type(threading.Lock()) and lock.acquire(False)",
        "generator recomputed": "list(gen) == [0, 1, 4, 9, 16]",
        "lost are absent": "[n for n in ('side', 'magic_gen', 'bad_gen') if n in globals()] == []",
    }
    for what, expression in checks.items():
        assert b.value(f"bool({expression})") is True, what
    # Restored functions see the new kernel's globals, not a frozen copy.
    b.cell("factor = 10")
    assert b.value("scale(2)") == 20

    # The next flush re-references the restored blobs instead of rewriting them.
    before = blob_stats(b.state_dir)
    again = b.call(FLUSH)
    assert set(doc["blobs"]) <= set(again["blobs"])
    after = blob_stats(b.state_dir)
    assert {sha: after[sha] for sha in doc["blobs"]} == {sha: before[sha] for sha in doc["blobs"]}
    resumed = json.loads((b.state_dir / "manifest.json").read_text())
    assert set(resumed["recipes"]) == {"fh", "gen", "lock"}
    assert resumed["imports"] == doc["imports"]
    assert b.call(RESTORE)["restored"] == report["restored"]  # safe to repeat


def test_unchanged_values_are_not_rewritten(start_kernel: Callable[[str], Kernel]) -> None:
    a = start_kernel("a")
    a.cell("import numpy as np\nkeep = np.arange(200_000.0)\nchange = np.ones(200_000)\n"
           "twin = keep.copy()")
    first = a.call(FLUSH)
    doc1 = json.loads((a.state_dir / "manifest.json").read_text())
    keep_sha = doc1["values"]["keep"]["buffers"][0]["blob"]
    change_sha = doc1["values"]["change"]["buffers"][0]["blob"]
    assert doc1["values"]["twin"]["buffers"][0]["blob"] == keep_sha  # stored once
    assert len(first["blobs"]) == 2
    stats1 = blob_stats(a.state_dir)

    time.sleep(0.05)  # let a rewrite show up in mtime_ns
    a.cell("print(keep.sum())")  # marks keep as possibly mutated: re-pickled, same content
    a.cell("change[0] = 42")
    a.call(FLUSH)
    doc2 = json.loads((a.state_dir / "manifest.json").read_text())
    stats2 = blob_stats(a.state_dir)
    assert doc2["values"]["keep"]["buffers"][0]["blob"] == keep_sha
    assert stats2[keep_sha] == stats1[keep_sha]
    new_sha = doc2["values"]["change"]["buffers"][0]["blob"]
    assert new_sha != change_sha
    assert set(stats2) == {keep_sha, new_sha}  # the old version was collected

    # A snapshot missing one blob still restores everything else.
    b = start_kernel("b")
    copy_snapshot(a.state_dir, b.state_dir)
    (b.state_dir / "blobs" / new_sha).unlink()
    report = b.call(RESTORE)
    assert [item["name"] for item in report["lost"]] == ["change"]
    assert "keep" in report["restored"]
    assert b.value("bool((keep == twin).all()) and not (keep.base is twin.base is not None)")
    b.cell("keep[0] = -1")  # twin came from the same blob but must not share memory
    assert b.value("float(twin[0])") == 0.0


def test_value_mutated_while_pickled_is_captured_at_flush(
        start_kernel: Callable[[str], Kernel]) -> None:
    a = start_kernel("a")
    a.cell("import threading, time\npickling = threading.Event()\n"
           "class Box:\n    def __init__(self, items=()):\n        self.items = list(items)\n"
           "    def __reduce__(self):\n        snapshot = list(self.items)\n"
           "        pickling.set()\n        time.sleep(0.5)\n        return (Box, (snapshot,))")
    a.cell("box = Box([1])")
    deadline = time.monotonic() + 10
    while not a.value("pickling.is_set()"):  # silent: starts no cell
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # The worker is pickling [1]; this cell changes box in a way no hook can see
    # (exec), and is still running when the worker finishes.
    a.cell("exec('box.items.append(2)')\ntime.sleep(1)")
    a.call(FLUSH)
    b = start_kernel("b")
    copy_snapshot(a.state_dir, b.state_dir)
    b.call(RESTORE)
    assert b.value("box.items") == [1, 2]


def test_pickling_happens_off_the_reply_path(start_kernel: Callable[[str], Kernel]) -> None:
    a = start_kernel("a")
    assert a.value("'nbfleet-capture' in [t.name for t in __import__('threading').enumerate()]")
    a.cell("import time\nclass Slow:\n    def __reduce__(self):\n        time.sleep(1)\n"
           "        return (Slow, ())")
    reply, out, elapsed = a.execute("s = Slow()")
    assert reply["status"] == "ok", out
    assert elapsed < 0.5
    reply, out, elapsed = a.execute("t = 1")
    assert reply["status"] == "ok" and elapsed < 0.5
    assert a.value("__import__('nbfleet.kernel').kernel._capture.last_post_run_seconds") < 0.05
    summary = a.call(FLUSH)
    assert summary["lost"] == []
    assert "s" in json.loads((a.state_dir / "manifest.json").read_text())["values"]


def test_corrupt_manifest_raises_and_leaves_namespace_alone(
        start_kernel: Callable[[str], Kernel]) -> None:
    b = start_kernel("b")
    b.cell("x = 1")
    assert b.call(RESTORE)["restored"] == []  # no manifest: nothing to do
    good: dict[str, Any] = {"format": 1, "imports": ["import json"], "blobs": [],
            "values": {"x": {"type": "builtins.int", "pickler": "cloudpickle",
                             "stream": {"inline": "gAVLAi4="}, "buffers": [], "size": 5}}}
    bad_documents = [
        "{not json",
        json.dumps({**good, "format": 2}),
        json.dumps({**good, "values": {"x": {**good["values"]["x"],
                                             "stream": {"blob": "../../etc/passwd"}}}}),
    ]
    for text in bad_documents:
        (b.state_dir / "manifest.json").write_text(text)
        reply, _, _ = b.execute(RESTORE, silent=True)
        assert reply["status"] == "error"
        assert reply["ename"] == "ValueError"
        assert b.value("[x, 'json' in globals()]") == [1, False]
    (b.state_dir / "manifest.json").write_text(json.dumps(good))
    assert b.call(RESTORE)["restored"] == ["x"]
    assert b.value("x") == 2


#: Before issue 13 this cell was re-run on every resume: it changes no user name.
LOGGING_CELL = ("import threading\n"
                "open('run.log', 'a').write('started\\n')\n"
                "lock = threading.Lock()")


def test_a_cell_that_writes_files_is_never_rerun(start_kernel: Callable[[str], Kernel]) -> None:
    """Issue 13: a line appended once appeared 4 times after 3 suspend/resume cycles."""
    a = start_kernel("a")
    a.cell(LOGGING_CELL)
    a.cell("gen = (i for i in range(3))")
    assert a.call(FLUSH)["lost"] == ["lock"]
    log = a.state_dir.parent / "work" / "run.log"
    previous = a
    for cycle in range(3):
        kernel = start_kernel(f"cycle{cycle}")
        copy_snapshot(previous.state_dir, kernel.state_dir)
        report = kernel.call(RESTORE)
        assert log.read_text() == "started\n", f"cycle {cycle}"
        assert report["recomputed"] == ["gen"]
        [lost] = report["lost"]
        assert lost["name"] == "lock" and lost["type"] == "_thread.lock"
        assert ("the cell that made it writes files (open(..., 'a')), so it is not re-run "
                "on resume") in lost["reason"]
        assert kernel.value("'lock' in globals()") is False
        assert kernel.call(FLUSH)["lost"] == ["lock"]
        previous = kernel


def test_a_replay_that_hangs_is_stopped_and_the_restore_completes(
        start_kernel: Callable[[str], Kernel]) -> None:
    a = start_kernel("a")
    a.cell("delay = 0")
    a.cell("import time, threading\ntime.sleep(delay)\nlock = threading.Lock()")
    a.cell("gen = (i for i in range(3))")
    a.cell("delay = 60")  # the replay reads today's value: it would sleep a minute
    a.call(FLUSH)
    assert set(json.loads((a.state_dir / "manifest.json").read_text())["recipes"]) == {
        "gen", "lock"}

    b = start_kernel("b")
    copy_snapshot(a.state_dir, b.state_dir)
    started = time.monotonic()
    report = b.call("__import__('nbfleet.kernel').kernel.restore(replay_budget_s=1.0)")
    assert time.monotonic() - started < 10
    assert report["recomputed"] == ["gen"]
    assert report["lost"] == [{
        "name": "lock", "type": "_thread.lock",
        "reason": "re-running the cell that made it took longer than 1 s, so it was stopped"}]
    assert "delay" in report["restored"]
    # The kernel works on, and its own sleeps are not cut short by the replay's timer.
    reply, _, elapsed = b.execute("import time\ntime.sleep(1.2)\nok = list(gen)")
    assert reply["status"] == "ok" and elapsed >= 1.2
    assert b.value("ok") == [0, 1, 2]


#: Issue 16: sharing, consumption, settings and a report that is never wrong, into a
#: kernel that is really fresh (another process: another hash seed, no figures).
CELLS_16 = [
    "%matplotlib inline",
    "import numpy as np, random, os, sys\nimport matplotlib.pyplot as plt",
    "base = np.arange(10.0)\nview = base[::2]\nl1 = l2 = [1, 2]\n"
    "words = {'alpha', 'beta', 'gamma', 'delta', 'epsilon'}",
    "fig, ax = plt.subplots()\nax.plot([1, 2, 3])\nax.set_title('t')",
    "plt.style.use('ggplot')\nrandom.seed(1)\nnp.random.seed(2)\n"
    "os.environ['NBF_ISSUE16'] = '1'\nsys.path.append('extra')",
    "it = iter([1, 2, 3])",
    "for x in it:\n    break",
    "class Drifts:\n    def __init__(self):\n        self.n = 1\n"
    "    def __setstate__(self, state):\n        self.__dict__.update(state)\n"
    "        self.n += 1\nd = Drifts()",
    "21 * 2",
]


def test_a_fresh_kernel_gets_graphs_settings_and_a_true_report(
        start_kernel: Callable[[str], Kernel], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPLBACKEND", "agg")  # as the agent starts kernels
    a = start_kernel("a")
    for code in CELLS_16:
        time.sleep(0.05)  # a person's pause: the capture worker keeps up
        a.cell(code)
    a.call(FLUSH)
    expected = a.value("[random.random(), float(np.random.rand())]")

    b = start_kernel("b")
    assert "inline" not in b.value("__import__('matplotlib').get_backend()")
    copy_snapshot(a.state_dir, b.state_dir)
    report = b.call(RESTORE)
    assert {"base", "view", "l1", "l2", "words", "it", "fig", "ax"} <= set(report["restored"])
    assert report["changed"] == ["d"]
    [drift] = [item for item in report["lost"] if item["name"] == "d"]
    assert drift["status"] == "changed" and "came back different" in drift["reason"]
    assert [item for item in report["lost"] if item["name"] != "d"] == []
    assert {"matplotlib backend", "matplotlib rcParams", "random state", "numpy.random state",
            "sys.path", "environment variables", "Out", "execution count"} <= set(
                report["settings"])
    checks = {
        "view shares": "bool(np.shares_memory(view, base)) and view.base is base",
        "aliases": "l1 is l2",
        "consumed": "list(it) == [2, 3]",
        "figure": "ax.figure is fig and ax.get_title() == 't'",
        "inline": "'inline' in __import__('matplotlib').get_backend()",
        "style": "plt.rcParams['axes.facecolor'] == '#E5E5E5'",
        "env and path": "os.environ['NBF_ISSUE16'] == '1' and sys.path[-1] == 'extra'",
        "Out": "Out[9] == 42 and _ == 42",
        "words": "words == {'alpha', 'beta', 'gamma', 'delta', 'epsilon'}",
    }
    for what, expression in checks.items():
        assert b.value(f"bool({expression})") is True, what
    assert b.value("[random.random(), float(np.random.rand())]") == expected
    reply, _, _ = b.execute("n = 1")
    assert reply["execution_count"] == 10  # the counter went on from where it was
