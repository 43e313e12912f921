"""Object graphs, not names: what a suspend saves is never stale, and a resume keeps
every sharing relationship, between changed names and unchanged ones alike.

Each test runs cells on a real IPython shell with pauses between them (the capture
worker finishes, as while a person reads the output), suspends, and resumes into
an emptied shell.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.kernel_shell import Session, shell


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    kernel = Session(shell(), tmp_path / "state")
    yield kernel
    kernel.close()


def round_trip(session: Session, fresh: Callable[[], None] | None = None) -> dict[str, Any]:
    session.suspend()
    report = session.resume(fresh)
    assert report["changed"] == [], report["lost"]
    return report


def manifest(session: Session) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((session.state_dir / "manifest.json").read_text())
    return doc


def test_a_view_and_its_base_still_share_memory(session: Session) -> None:
    session.cell("import numpy as np\nbase = np.arange(10.0)")
    session.cell("view = base[::2]")  # only view changes: base is unchanged here
    session.cell("view[0] = 99")
    report = round_trip(session)
    ns = session.ns
    assert {"base", "view"} <= set(report["restored"])
    assert np.shares_memory(ns["view"], ns["base"]) and ns["view"].base is ns["base"]
    assert ns["base"][0] == 99
    session.cell("view[1] = -1")
    assert ns["base"][2] == -1


def test_views_of_big_fortran_and_reversed_arrays_share_memory(session: Session) -> None:
    session.cell("import numpy as np\nbig = np.zeros(1_000_000)\npart = big[10:20]")
    session.cell("f = np.asfortranarray(np.arange(12.0).reshape(3, 4))\nflipped = f[:, ::-1]")
    session.cell("t = big.reshape(1000, 1000).T[::3]")
    session.suspend()
    group = next(g for g in manifest(session)["groups"] if "big" in g["names"])
    assert {"big", "part", "t"} <= set(group["names"])
    assert [set(ref) for ref in group["buffers"]] == [{"blob"}]  # 8 MB: one blob, once
    report = session.resume()
    assert report["changed"] == []
    ns = session.ns
    assert np.shares_memory(ns["part"], ns["big"]) and np.shares_memory(ns["t"], ns["big"])
    assert np.shares_memory(ns["flipped"], ns["f"]) and ns["f"].flags.f_contiguous
    assert ns["flipped"][0, 0] == 3.0 and ns["t"].shape == (334, 1000)
    session.cell("big[10] = 5\nf[0, 3] = -7")
    assert ns["part"][0] == 5 and ns["flipped"][0, 0] == -7


def test_a_read_only_view_stays_read_only(session: Session) -> None:
    session.cell("import numpy as np\nsrc = np.arange(4)\nro = np.broadcast_to(src, (3, 4))")
    round_trip(session)
    ns = session.ns
    assert not ns["ro"].flags.writeable and np.shares_memory(ns["ro"], ns["src"])


def test_aliases_and_mutual_references_stay_one_object(session: Session) -> None:
    session.cell("l1 = l2 = [1, 2]")
    session.cell("outer = {'x': l1}")
    session.cell("a = {}\nb = {'a': a}\na['b'] = b")
    report = round_trip(session)
    ns = session.ns
    assert {"l1", "l2", "outer", "a", "b"} <= set(report["restored"])
    assert ns["l1"] is ns["l2"] is ns["outer"]["x"]
    assert ns["a"]["b"] is ns["b"] and ns["b"]["a"] is ns["a"]


def test_a_mutation_through_another_name_is_saved(session: Session) -> None:
    session.cell("a = [1]")
    session.cell("b = {'k': a}")
    session.cell("b['k'].append(2)")  # a is not named, but it changed
    round_trip(session)
    assert session.ns["a"] == [1, 2] and session.ns["b"]["k"] is session.ns["a"]


def test_a_change_no_cell_names_is_found_after_the_cell(session: Session) -> None:
    """exec() hides the change from the AST scan: the digest check after the cell
    sees it, before any flush."""
    session.cell("data = [1, 2]")
    before = session.capture.records["data"]
    session.cell("exec('data.append(3)')")
    after = session.capture.records["data"]
    assert after is not before and after.entry != before.entry  # type: ignore[union-attr]
    round_trip(session)
    assert session.ns["data"] == [1, 2, 3]


def test_a_change_without_a_pause_is_caught_by_the_flush(session: Session) -> None:
    session.cell("data = {'n': 1}")
    session.cell("exec('data[\"n\"] = 2')", pause=False)
    round_trip(session)
    assert session.ns["data"] == {"n": 2}


def test_a_consumed_iterator_comes_back_consumed(session: Session) -> None:
    session.cell("it = iter([1, 2, 3])\nother = iter('abc')")
    session.cell("for x in it:\n    break")
    session.cell("exec('next(other)')")  # no cell names it: found by the check
    report = round_trip(session)
    assert {"it", "other"} <= set(report["restored"])
    assert list(session.ns["it"]) == [2, 3] and list(session.ns["other"]) == ["b", "c"]


def test_a_consumed_generator_is_recomputed_consumed(session: Session) -> None:
    """Generators cannot be pickled: the cells that made and consumed one are re-run."""
    session.cell("gen = (i for i in range(5))")
    session.cell("for g in gen:\n    if g == 1:\n        break")
    session.suspend()
    report = session.resume()
    assert report["recomputed"] == ["gen"] and list(session.ns["gen"]) == [2, 3, 4]


def test_a_figure_and_its_axes_stay_one_object(session: Session) -> None:
    session.cell("import matplotlib\nmatplotlib.use('agg')\nimport matplotlib.pyplot as plt")
    session.cell("fig, ax = plt.subplots()\nax.plot([1, 2, 3])")
    session.cell("ax.set_title('title')")
    session.cell("plt.xlabel('drawn through pyplot')")  # neither fig nor ax is named
    import matplotlib.pyplot as plt

    report = round_trip(session, lambda: plt.close("all"))  # a new kernel has no figures
    ns = session.ns
    assert {"fig", "ax"} <= set(report["restored"])
    assert ns["ax"].figure is ns["fig"] and ns["fig"].axes[0] is ns["ax"]
    assert ns["ax"].get_title() == "title" and ns["ax"].get_xlabel() == "drawn through pyplot"
    session.cell("plt.close('all')")


def test_shared_pandas_indexes_stay_shared(session: Session) -> None:
    session.cell("import pandas as pd\n"
                 "index = pd.MultiIndex.from_tuples([('a', 1), ('b', 2)])\n"
                 "pop = pd.Series([10, 20], index=index)\n"
                 "frame = pd.DataFrame({'x': [1, 2]}, index=index)")
    session.cell("pop.index.names = ['state', 'year']")
    round_trip(session)
    ns = session.ns
    assert list(ns["index"].names) == ["state", "year"]
    assert ns["pop"].index is ns["index"] is ns["frame"].index


def test_out_keeps_pointing_at_the_named_object(session: Session) -> None:
    session.cell("rows = [1, 2, 3]")
    session.cell("rows")  # Out[2] is rows
    session.cell("rows.append(4)")
    round_trip(session)
    ns = session.ns
    assert ns["Out"][2] is ns["rows"] and ns["rows"] == [1, 2, 3, 4]


def test_names_that_share_nothing_keep_their_own_entries(session: Session) -> None:
    session.cell("import numpy as np\nkeep = np.arange(200_000.0)\ntwin = keep.copy()\nn = 3")
    session.suspend()
    doc = manifest(session)
    assert doc["groups"] == []
    assert doc["values"]["keep"]["buffers"] == doc["values"]["twin"]["buffers"]  # stored once
    assert all("digest" in entry for entry in doc["values"].values())
    session.resume()
    assert not np.shares_memory(session.ns["keep"], session.ns["twin"])


def test_the_scan_sees_what_a_loop_iterates() -> None:
    from nbfleet.kernel import cellscan

    scan = cellscan.scan("for x in it:\n    pass\ntotal = sum(v for v in gen)\n"
                         "for row in table.rows:\n    pass", {})
    assert scan.iterated == {"it", "gen", "table"}
