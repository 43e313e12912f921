"""scan(): which names a cell defines, mutates, deletes, reads and imports."""

from __future__ import annotations

import keyword
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbfleet.kernel.cellscan import CellScan, import_bindings, scan

KNOWN = {"helper": frozenset({"registry", "config"})}

# (id, source, expected: {field: value}); fields not named are not checked.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("assign", "x = 1", {"defined": {"x"}, "mutated": set(), "loaded": set()}),
    ("chained", "a = b = c", {"defined": {"a", "b"}, "loaded": {"c"}}),
    ("tuple unpack", "a, (b, c) = pair", {"defined": {"a", "b", "c"}, "loaded": {"pair"}}),
    ("list starred", "[first, *rest] = items", {"defined": {"first", "rest"}}),
    ("annotated", "y: int = 3\nz: str", {"defined": {"y"}, "loaded": {"int", "str"}}),
    ("augmented name", "total += x", {"defined": {"total"}, "loaded": {"total", "x"},
                                       "mutated": set()}),
    ("augmented subscript", "counts['a'] += 1", {"defined": set(), "mutated": {"counts"}}),
    ("augmented attribute", "obj.n -= 1", {"mutated": {"obj"}}),
    ("subscript store", "table[key] = value",
     {"defined": set(), "mutated": {"table"}, "loaded": {"table", "key", "value"}}),
    ("deep store", "cfg.a[0].b = 1", {"mutated": {"cfg"}}),
    ("attribute store", "model.weights = w", {"mutated": {"model"}, "defined": set()}),
    ("del subscript/attr", "del cache[k], obj.attr",
     {"mutated": {"cache", "obj"}, "deleted": set()}),
    ("del name", "del a, b", {"deleted": {"a", "b"}, "mutated": set(), "defined": set()}),
    ("method call", "df.dropna(inplace=True)", {"mutated": {"df"}}),
    ("nested method call", "model.layers.append(layer)", {"mutated": {"model", "layer"}}),
    ("subscript method call", "groups[0].append(1)", {"mutated": {"groups"}}),
    ("call arguments", "train(model, data=batches, *extra, **opts)",
     {"mutated": {"model", "batches", "extra", "opts"}, "loaded": {"train", "model", "batches",
                                                                   "extra", "opts"}}),
    ("expressions are not mutated", "result = f(x + 1, [y])",
     {"mutated": set(), "defined": {"result"}}),
    ("chained call root unknown", "load().fit(x)", {"mutated": {"x"}}),
    ("for target", "for i, row in enumerate(rows):\n    pass",
     {"defined": {"i", "row"}, "mutated": {"rows"}}),
    ("for mutates iterable", "for row in rows:\n    row.append(0)",
     {"defined": {"row"}, "mutated": {"row", "rows"}}),
    ("for without mutation", "for row in rows:\n    print(1)",
     {"defined": {"row"}, "mutated": set()}),
    ("async for", "async def f():\n    pass\nasync for x in stream():\n    pass",
     {"defined": {"f", "x"}}),
    ("with as", "with open(p) as fh, lock:\n    data = fh.read()",
     {"defined": {"fh", "data"}, "mutated": {"p", "fh"}}),
    ("with tuple target", "with ctx() as (a, b):\n    pass", {"defined": {"a", "b"}}),
    ("walrus", "if (n := len(xs)) > 2:\n    big = True", {"defined": {"n", "big"}}),
    ("walrus in comprehension binds outside", "[(last := v) for v in vals]",
     {"defined": {"last"}, "loaded": {"vals"}}),
    ("comprehension variables are local", "squares = [i * i for i in range(k)]",
     {"defined": {"squares"}, "loaded": {"range", "k"}, "mutated": {"k"}}),
    ("dict/set/generator comprehensions", "d = {k: v for k, v in pairs}\n"
     "s = {w for w in words}\ng = (z for z in zs if z)",
     {"defined": {"d", "s", "g"}, "loaded": {"pairs", "words", "zs"}}),
    ("comprehension mutating its element", "[q.pop() for q in queues]",
     {"mutated": {"queues"}, "defined": set()}),
    ("nested comprehension", "flat = [c for row in grid for c in row]",
     {"defined": {"flat"}, "loaded": {"grid"}}),
    ("if/while/try bodies are module scope",
     "if flag:\n    a = 1\nelse:\n    b = 2\nwhile go:\n    c = 3\n"
     "try:\n    d = 4\nexcept ValueError as err:\n    e = 5\nfinally:\n    f = 6",
     {"defined": {"a", "b", "c", "d", "e", "f"}}),
    ("match captures",
     "match cmd:\n    case [op, *args]:\n        pass\n    case {'k': v, **rest}:\n        pass\n"
     "    case Point(x=px) as pt:\n        pass",
     {"defined": {"op", "args", "v", "rest", "px", "pt"}, "loaded": {"cmd", "Point"}}),
    ("import", "import numpy as np\nimport os.path\nimport a.b as c",
     {"defined": {"np", "os", "c"},
      "imports": ("import numpy as np", "import os.path", "import a.b as c")}),
    ("from import", "from os import path as p, sep\nfrom x import *",
     {"defined": {"p", "sep"}, "imports": ("from os import path as p, sep", "from x import *")}),
    ("relative import", "from .pkg import mod", {"imports": ("from .pkg import mod",)}),
    ("imports deduplicated, in order", "import b\nimport a\nimport b",
     {"imports": ("import b", "import a")}),
    ("imports in control flow are module scope",
     "try:\n    import ujson as json\nexcept ImportError:\n    import json",
     {"imports": ("import ujson as json", "import json"), "defined": {"json"}}),
    ("imports in def are not", "def f():\n    import os\n    return os",
     {"imports": (), "defined": {"f"}}),
    ("def body is not module scope", "def f(a, *args, k=default, **kw):\n    local = a\n"
     "    glob.append(local)\n    return other",
     {"defined": {"f"}, "mutated": set(), "loaded": {"default"},
      "functions": {"f": {"glob", "other"}}}),
    ("def declares global", "def set_x(v):\n    global x\n    x = v",
     {"defined": {"set_x"}, "functions": {"set_x": {"x"}}}),
    ("def with nested function", "def outer(a):\n    def inner():\n        return a + g\n"
     "    return inner",
     {"functions": {"outer": {"g"}}}),
    ("decorator runs at definition", "@register(app)\ndef view():\n    pass",
     {"defined": {"view"}, "mutated": {"app"}, "loaded": {"register", "app"}}),
    ("class body names are class-local",
     "class C(Base):\n    size = 3\n    registry.append(size)\n    def m(self):\n"
     "        return hidden",
     {"defined": {"C"}, "mutated": {"registry"}, "loaded": {"Base", "registry"},
      "functions": {}}),
    ("lambda body is not module scope", "key = lambda r: r[col]",
     {"defined": {"key"}, "loaded": {"col"}, "mutated": set()}),
    ("known footprint propagates", "helper()",
     {"mutated": {"registry", "config"}, "defined": set()}),
    ("same-cell function footprint propagates",
     "def add(v):\n    items.append(v)\nadd(1)",
     {"defined": {"add"}, "mutated": {"items"}, "functions": {"add": {"items"}}}),
    ("footprint closes over calls",
     "def a():\n    b()\ndef b():\n    state.x = 1\na()",
     {"functions": {"a": {"b", "state"}, "b": {"state"}}, "mutated": {"b", "state"}}),
    ("footprint through known function", "def run():\n    helper()",
     {"functions": {"run": {"helper", "registry", "config"}}}),
    ("unknown function call mutates only arguments", "result = compute(a)",
     {"mutated": {"a"}, "defined": {"result"}}),
    ("magic on transformed source", "get_ipython().run_line_magic('pip', 'install x')",
     {"uses_magic": True, "mutated": set(), "defined": set()}),
    ("cell magic assignment", "out = get_ipython().run_cell_magic('time', '', 'y = 1\\n')",
     {"uses_magic": True, "defined": {"out"}}),
    ("no magic", "x = ipython_like()", {"uses_magic": False}),
    ("top-level await", "data = await fetch(url)", {"defined": {"data"}, "mutated": {"url"}}),
    ("except name is unbound after the handler",
     "try:\n    pass\nexcept Exception as exc:\n    saved = exc",
     {"defined": {"saved"}}),
]


@pytest.mark.parametrize(("source", "expected"), [pytest.param(s, e, id=i) for i, s, e in CASES])
def test_scan(source: str, expected: dict[str, Any]) -> None:
    result = scan(source, KNOWN)
    for field, want in expected.items():
        got = getattr(result, field)
        if field == "functions":
            got = {name: set(names) for name, names in got.items()}
        elif isinstance(got, frozenset):
            got = set(got)
        assert got == want, f"{field}: {got!r} != {want!r}"


@pytest.mark.parametrize("source", ["def (:", "x = = 1", "if x\n  y", "a = 'unterminated"])
def test_syntax_error_gives_empty_scan(source: str) -> None:
    assert scan(source, KNOWN) == CellScan()


def test_import_bindings() -> None:
    assert import_bindings("import a.b as c, d.e") == ["c", "d"]
    assert import_bindings("from x import *") == []
    assert import_bindings("x = 1") == []


names = st.text("abcdefghij", min_size=1, max_size=4).filter(lambda s: not keyword.iskeyword(s))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["=", "+=", "[0] =", ".a =", ".m(", "del"]),
                          names, names), min_size=1, max_size=12))
def test_generated_statements(statements: list[tuple[str, str, str]]) -> None:
    """Every statement's effect lands in exactly the set the rules put it in."""
    lines = []
    defined, mutated, deleted = set(), set(), set()
    for op, target, other in statements:
        if op == "del":
            lines.append(f"del {target}")
            deleted.add(target)
        elif op == ".m(":
            lines.append(f"{target}.m({other})")
            mutated |= {target, other}
        elif op in ("=", "+="):
            lines.append(f"{target} {op} {other}")
            defined.add(target)
        else:
            lines.append(f"{target}{op} {other}")
            mutated.add(target)
    result = scan("\n".join(lines), {})
    assert result.defined == defined
    assert result.mutated == mutated
    assert result.deleted == deleted
    assert result.imports == ()


def test_definitions_are_the_sources_of_defs_and_named_lambdas() -> None:
    """A later cell's replay re-defines the functions it calls from these."""
    found = scan("def f(x):\n    return x\ng = lambda: 1\nif flag:\n    def h():\n        pass\n"
                 "else:\n    def h():\n        return 2\nclass C:\n    def m(self):\n        pass\n"
                 "k = m = lambda: 2", {}).definitions
    assert found == {"f": "def f(x):\n    return x", "g": "g = lambda: 1"}
