"""Kernel configuration is state: a resume puts back matplotlib's backend, style and
rcParams, the RNGs, ``sys.path``, the environment, the directory, ``%config``,
magics, display formatters, ``In``/``Out`` and the counter, and names what it
could not put back.

The shell lives in this process, so what a fresh kernel would not have is undone
by hand (``fresh``) between the suspend and the resume.
"""

from __future__ import annotations

import os
import random
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pytest

from nbfleet.kernel import ipysettings, settings
from tests.support.kernel_shell import Session, shell


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Session]:
    start = tmp_path / "work"
    (start / "sub").mkdir(parents=True)
    monkeypatch.chdir(start)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("NBF_TEST_GONE", "x")
    monkeypatch.delenv("NBF_TEST_FLAG", raising=False)
    ip = shell()
    monkeypatch.setattr(ip, "enable_gui", lambda gui=None: None, raising=False)  # ipykernel's
    kernel = Session(ip, tmp_path / "state")
    yield kernel
    kernel.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        matplotlib.rcdefaults()


def by_name(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {item["name"]: item for item in report["lost"]}


def test_process_settings_come_back(session: Session, tmp_path: Path) -> None:
    start = Path.cwd()
    session.cell("import os, sys\nos.chdir('sub')\nsys.path.insert(0, 'mylibs')\n"
                 f"sys.path.append({str(start / 'sub')!r})")
    session.cell("os.environ['NBF_TEST_FLAG'] = '1'\ndel os.environ['NBF_TEST_GONE']")
    session.suspend()

    def fresh() -> None:
        os.chdir(start)
        sys.path[:] = [p for p in sys.path if p not in ("mylibs", str(start / "sub"))]
        os.environ["NBF_TEST_GONE"] = "x"
        del os.environ["NBF_TEST_FLAG"]

    report = session.resume(fresh)
    assert Path.cwd() == start / "sub"
    assert sys.path[0] == "mylibs" and sys.path[-1] == str(start / "sub")
    assert os.environ["NBF_TEST_FLAG"] == "1" and "NBF_TEST_GONE" not in os.environ
    assert {"working directory", "sys.path", "environment variables"} <= set(report["settings"])
    assert report["lost"] == []


def test_paths_under_the_start_directory_move_with_it(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed kernel may start elsewhere: the notebook's directory is followed."""
    old, new = tmp_path / "old", tmp_path / "new"
    (new / "data").mkdir(parents=True)
    monkeypatch.chdir(new)
    monkeypatch.setattr(sys, "path", ["/lib"])
    doc = {"cwd": {"start": str(old), "now": str(old / "data")},
           "path": {"start": str(old), "base": ["/lib"], "now": [str(old / "pkgs"), "/lib"]}}
    baseline = settings.Baseline({}, ["/lib"], str(new),
                                 ipysettings.Baseline({}, frozenset(), frozenset(), frozenset()),
                                 [])
    outcome = settings.prepare(doc, baseline)
    assert outcome.lost == [] and Path.cwd() == new / "data"
    assert sys.path == [str(new / "pkgs"), "/lib"]


def test_random_generators_continue_where_they_were(session: Session) -> None:
    session.cell("import random\nimport numpy as np\nrandom.seed(3)\nnp.random.seed(5)\n"
                 "first = random.random(), np.random.rand()")
    expected = (random.getstate(), np.random.get_state())
    session.suspend()

    def fresh() -> None:
        random.seed(99)
        np.random.seed(99)

    report = session.resume(fresh)
    assert random.getstate() == expected[0]
    state = np.random.get_state()
    assert state[0] == expected[1][0] and (state[1] == expected[1][1]).all()  # type: ignore[index]
    assert state[2:] == expected[1][2:]  # type: ignore[index]
    assert {"random state", "numpy.random state"} <= set(report["settings"])
    session.cell("again = random.random(), np.random.rand()")


def test_matplotlib_inline_style_and_rcparams_come_back(session: Session) -> None:
    session.cell("%matplotlib inline")
    session.cell("import matplotlib.pyplot as plt\nplt.style.use('ggplot')\n"
                 "plt.rcParams['lines.linewidth'] = 3.5")
    session.cell("%config InlineBackend.figure_format = 'svg'")
    session.suspend()
    from matplotlib_inline.backend_inline import InlineBackend, flush_figures

    def fresh() -> None:
        session.shell.events.unregister("post_execute", flush_figures)
        matplotlib.use("agg")
        InlineBackend.instance().figure_formats = {"png"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            matplotlib.rcdefaults()

    report = session.resume(fresh)
    assert flush_figures in session.shell.events.callbacks["post_execute"]
    assert "inline" in matplotlib.get_backend()
    assert matplotlib.rcParams["lines.linewidth"] == 3.5
    assert matplotlib.rcParams["axes.facecolor"] == "#E5E5E5"  # ggplot's
    assert InlineBackend.instance().figure_formats == {"svg"}
    from matplotlib.figure import Figure

    svg = session.shell.display_formatter.formatters["image/svg+xml"]
    assert svg.lookup_by_type(Figure) is not None  # figures display as SVG again
    assert report["lost"] == [], report["lost"]
    assert {"%matplotlib inline", "matplotlib backend", "matplotlib rcParams",
            "%config InlineBackend.figure_formats"} <= set(report["settings"])
    session.shell.events.unregister("post_execute", flush_figures)
    matplotlib.use("agg")


def test_config_magics_and_formatters_come_back(session: Session, tmp_path: Path) -> None:
    (tmp_path / "fakesym.py").write_text(textwrap.dedent("""
        class Expr:
            pass
        class Hidden:
            pass
        def init_printing():
            fmt = get_ipython().display_formatter.formatters['text/latex']
            fmt.for_type(Expr, lambda e: '$e$')
        def register_hidden():
            fmt = get_ipython().display_formatter.formatters['text/latex']
            fmt.for_type(Hidden, lambda e: '$h$')
    """).replace("get_ipython()", "__import__('IPython').get_ipython()"))
    sys.path.insert(0, str(tmp_path))
    session.cell("%precision 3")
    session.cell("%config InteractiveShell.ast_node_interactivity = 'all'")
    session.cell("from IPython.core.magic import register_line_magic\n"
                 "@register_line_magic\ndef shout(line):\n    return line.upper()")
    session.cell("class Point:\n    pass\n"
                 "get_ipython().display_formatter.formatters['text/html'].for_type(\n"
                 "    Point, lambda p: '<b>point</b>')")
    session.cell("from fakesym import Expr, init_printing\nimport fakesym")
    session.cell("init_printing()")
    session.cell("fakesym.register_hidden()")  # not a call nbfleet records
    session.suspend()
    ip = session.shell
    latex = ip.display_formatter.formatters["text/latex"]

    def fresh() -> None:
        ip.display_formatter.formatters["text/plain"].float_precision = ""
        ip.ast_node_interactivity = "last_expr"
        del ip.magics_manager.magics["line"]["shout"]
        for kind in list(latex.type_printers):
            if kind.__module__ == "fakesym":
                del latex.type_printers[kind]
        html = ip.display_formatter.formatters["text/html"]
        for kind in [k for k in html.type_printers if k.__name__ == "Point"]:
            del html.type_printers[kind]

    report = session.resume(fresh)
    ns = session.ns
    assert ip.display_formatter.formatters["text/plain"].float_precision == "3"
    assert ip.ast_node_interactivity == "all"
    assert ip.run_line_magic("shout", "hi") == "HI"
    assert ip.display_formatter.format(ns["Point"]())[0]["text/html"] == "<b>point</b>"
    assert ip.display_formatter.format(ns["Expr"]())[0]["text/latex"] == "$e$"
    assert "init_printing()" in report["settings"]
    lost = by_name(report)
    assert set(lost) == {"display formatter text/latex for fakesym.Hidden"}
    assert lost["display formatter text/latex for fakesym.Hidden"]["type"] == "kernel setting"
    ip.ast_node_interactivity = "last_expr"
    ip.run_line_magic("precision", "")  # numpy's print options too
    sys.modules.pop("fakesym", None)


def test_in_out_and_the_counter_come_back(session: Session) -> None:
    session.cell("1 + 1")
    session.cell("'x' * 2")
    session.cell("y = 5")
    session.suspend()
    report = session.resume()
    ip, ns = session.shell, session.ns
    assert ip.execution_count == 4
    assert ns["Out"] == {1: 2, 2: "xx"} and ns["_2"] == "xx" and ns["_"] == "xx"
    assert ns["In"][1:] == ["1 + 1", "'x' * 2", "y = 5"] and ns["_i1"] == "1 + 1"
    assert {"In", "Out", "execution count"} <= set(report["settings"])
    session.cell("z = 1")
    assert ip.execution_count == 5


def test_configuration_calls_are_recorded_as_typed() -> None:
    from IPython.core.inputtransformer2 import TransformerManager

    from nbfleet.kernel import cellscan

    source = TransformerManager().transform_cell(  # type: ignore[no-untyped-call]
        "%matplotlib inline\nimport sympy as sp\nsp.init_printing(use_latex=True)\n"
        "x = init_printing\n%time y = 1\nprint('init_printing')")
    recorded = cellscan.scan(source, {}).settings
    assert recorded == ("get_ipython().run_line_magic('matplotlib', 'inline')",
                        "sp.init_printing(use_latex=True)")
    assert ipysettings.label(recorded[0]) == "%matplotlib inline"
    log = settings.CallLog()
    log.record(recorded)
    log.record(("get_ipython().run_line_magic('matplotlib', 'widget')",
                "sp.init_printing(use_latex=True)"))
    assert log.calls == ["get_ipython().run_line_magic('matplotlib', 'widget')",
                         "sp.init_printing(use_latex=True)"]  # the last backend only


def test_a_warning_already_shown_is_not_shown_again_after_resume(
        session: Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    (tmp_path / "nbf_warner.py").write_text(
        "import warnings\ndef fit():\n    warnings.warn('did not converge', RuntimeWarning)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    request.addfinalizer(lambda: sys.modules.pop("nbf_warner", None))  # and its registry
    shown: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kw: shown.append(
        str(message)))
    with warnings.catch_warnings():
        warnings.resetwarnings()  # Python's own defaults, not pytest's "always"
        warnings.simplefilter("default")
        session.cell("import warnings\nwarnings.filterwarnings('ignore', message='nbf-noise')")
        session.cell("import nbf_warner\nnbf_warner.fit()")
        session.cell("nbf_warner.fit()")
        assert shown == ["did not converge"]  # once per place, as Python shows it
        session.suspend()

        def fresh() -> None:  # a new kernel: its modules have seen nothing
            vars(sys.modules["nbf_warner"]).pop("__warningregistry__", None)
            warnings.filters[:] = [f for f in warnings.filters
                                   if not (f[1] and f[1].pattern == "nbf-noise")]
            warnings._filters_mutated()  # type: ignore[attr-defined]

        report = session.resume(fresh)
        assert {"warnings already shown", "warning filters"} <= set(report["settings"])
        session.cell("nbf_warner.fit()\nwarnings.warn('nbf-noise')")
    assert shown == ["did not converge"]


def test_warning_state_never_fails_a_suspend_or_wakes_a_lazy_module(
        session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import types

    from nbfleet.kernel import warnstate

    class Loader(importlib.abc.Loader):
        def create_module(self, spec: Any) -> None:
            return None

        def exec_module(self, module: types.ModuleType) -> None:
            raise RuntimeError("a lazy module was loaded by the suspend")

    spec = importlib.util.spec_from_loader("nbf_lazy", importlib.util.LazyLoader(Loader()))
    assert spec is not None
    lazy = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(lazy)
    monkeypatch.setitem(sys.modules, "nbf_lazy", lazy)
    session.cell("x = 1")
    session.suspend()  # reads every module's registry: the lazy one stays unloaded

    def boom(shell: Any, doc: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
        raise RuntimeError("broken")

    monkeypatch.setattr(warnstate, "restore", boom)
    report = session.resume()
    assert session.ns["x"] == 1
    assert "warnings already shown" in by_name(report)
