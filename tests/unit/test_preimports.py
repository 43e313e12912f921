"""preimports: which modules a snapshot needs, as names only the kernel will import.

The names come from a user's snapshot: only plain dotted names whose module files
exist in the kernels' base environment, and not in the workspace's own layer, are
kept; nothing is ever imported by the agent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nbfleet.agent import preimports
from nbfleet.agent.preimports import BaseEnvironment, needs, statement_modules
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.snapshots import manifest_key

pytestmark = pytest.mark.no_db


@pytest.fixture
def env(tmp_path: Path) -> BaseEnvironment:
    """A site-packages with a package, a submodule, a subpackage and an extension,
    and a standard library with ``json``."""
    site, stdlib = tmp_path / "site", tmp_path / "stdlib"
    for path in ("heavy/__init__.py", "heavy/linear/__init__.py", "heavy/linear/_base.py",
                 "numpy/__init__.py", "plain.py", "nbfleet/__init__.py", "this.py"):
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text("")
    (site / "fast.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (site / "heavy" / "stats").mkdir()  # a namespace package
    (stdlib / "json").mkdir(parents=True)
    (stdlib / "json" / "__init__.py").write_text("")
    return BaseEnvironment((str(stdlib), str(site)), frozenset({"sys", "_thread"}))


@pytest.mark.parametrize(("statement", "modules"), [
    ("import heavy", ["heavy"]),
    ("import heavy.linear as hl, numpy as np", ["heavy.linear", "numpy"]),
    ("from heavy.linear import Model, _base as b", ["heavy.linear", "heavy.linear.Model",
                                                     "heavy.linear._base"]),
    ("from heavy import (stats, linear)", ["heavy", "heavy.stats", "heavy.linear"]),
    ("from . import sibling", []),
    ("from .pkg import x", []),
    ("from heavy import *", ["heavy"]),
    ("import os; import shutil", []),
    ("x = 1", []),
    ("import " + "a." * 600 + "b", []),
])
def test_the_modules_of_an_import_statement(statement: str, modules: list[str]) -> None:
    assert statement_modules(statement) == modules


def test_only_modules_found_in_the_base_environment_are_kept(env: BaseEnvironment) -> None:
    manifest = {
        "imports": ["import heavy.linear as hl", "from heavy import stats, Thing",
                    "import nbf_user_pkg", "import json", "import _thread", "import this",
                    "from heavy.linear import Model", 42],
        "values": {"m": {"type": "heavy.linear._base.Model"},
                   "a": {"type": "numpy.ndarray"},
                   "f": {"type": "fast.Thing"},
                   "d": {"type": "builtins.dict"},
                   "c": {"type": "__main__.Point"},
                   "bad": "not an entry"},
    }
    found = needs(manifest, env)
    assert found.modules == ("heavy.linear", "heavy", "heavy.stats", "json", "_thread",
                             "heavy.linear._base", "numpy", "fast")
    # Worth a prepared kernel: not the standard library, not what warm kernels hold.
    assert found.profile == frozenset({"heavy.linear", "heavy", "heavy.stats",
                                       "heavy.linear._base", "fast"})


def test_names_the_layer_provides_are_left_to_the_restore(env: BaseEnvironment) -> None:
    found = needs({"imports": ["import heavy.linear", "import plain"]}, env,
                  shadowed=frozenset({"heavy"}))
    assert found.modules == ("plain",)


def test_nothing_that_is_not_a_dotted_name_gets_through(env: BaseEnvironment) -> None:
    manifest = {"imports": ["import heavy\n__import__('os').system('x')"],
                "values": {"v": {"type": "heavy.__import__('os').X"},
                           "w": {"type": "héavy.X"}, "u": {"type": "../../etc.X"}}}
    assert needs(manifest, env).modules == ()


def test_a_snapshot_lists_at_most_max_modules(env: BaseEnvironment,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preimports, "MAX_MODULES", 2)
    found = needs({"imports": ["import heavy, plain, fast, json"]}, env)
    assert found.modules == ("heavy", "plain")


def test_the_real_environment_finds_installed_packages() -> None:
    env = BaseEnvironment.of_kernels()
    assert env.has("json") and env.has("numpy") and env.has("matplotlib.pyplot")
    assert env.has("_thread") and not env.has("no_such_module_xyz")
    assert not env.has("json.nope")


def test_a_manifest_that_does_not_parse_needs_nothing() -> None:
    assert preimports.parse_manifest(None) == {}
    assert preimports.parse_manifest(b"{not json") == {}
    assert preimports.parse_manifest(b"[1, 2]") == {}
    assert preimports.parse_manifest(b'{"format": 1}') == {"format": 1}


def test_the_top_level_names_of_a_package_layer(tmp_path: Path) -> None:
    for name in ("nbf_demo", "nbf_demo-0.1.dist-info", "bin", "__pycache__", "numpy"):
        (tmp_path / name).mkdir()
    for name in ("single.py", "ext.cpython-311-x86_64-linux-gnu.so", "dist.pth"):
        (tmp_path / name).write_text("")
    assert preimports.layer_modules(str(tmp_path)) == {"nbf_demo", "numpy", "single", "ext"}
    assert preimports.layer_modules(str(tmp_path / "missing")) == frozenset()
    assert preimports.shadowed(["numpy", "pandas"], frozenset({"numpy"}))
    assert not preimports.shadowed(["numpy.linalg"], frozenset({"nump"}))


def test_the_kernel_request_carries_the_names_as_a_literal() -> None:
    code = preimports.preimport_code(["heavy.linear", "x'); import os; ('", "json"])
    assert code.endswith("kernel._preimport('heavy.linear,json')")
    compile(code, "<preimport>", "exec")  # one valid request, whatever the names were


def test_a_snapshot_is_read_ahead_only_from_the_workspace_s_own_keys(
        tmp_path: Path, env: BaseEnvironment) -> None:
    store = BlobStore(str(tmp_path / "blobs"))
    mine = manifest_key("ws_a", "k1")
    store.put(mine, json.dumps({"imports": ["import heavy"]}).encode())
    theirs = manifest_key("ws_b", "k2")
    store.put(theirs, json.dumps({"imports": ["import plain"]}).encode())
    found = preimports.snapshot_needs(store, "ws_a", {"k1": mine, "k2": theirs,
                                                      "k3": manifest_key("ws_a", "k3")}, env)
    assert found == {"k1": preimports.Needs(("heavy",), frozenset({"heavy"}))}
