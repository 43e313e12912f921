"""purity.check(): which cells may be re-run on resume (an allowlist), and why not.

Cells are given as IPython transforms them (``!cmd`` and ``%magic`` become
``get_ipython()`` calls before any AST is seen), against a namespace like the one a
replay would see.
"""

from __future__ import annotations

import io
import itertools
import os
import pathlib
import re
import socket
import subprocess
import threading
from typing import Any

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from nbfleet.kernel import cellscan
from nbfleet.kernel.purity import Namespace, Verdict, check, is_plain

_transform = TransformerManager().transform_cell  # type: ignore[no-untyped-call]


class Logger:
    def __init__(self) -> None:
        with open("log.txt", "a") as out:
            out.write("hello\n")


class Opaque:
    def save(self, path: str) -> None:
        pathlib.Path(path).write_text("x")


def helper_without_source() -> threading.Lock:
    return threading.Lock()


#: What a notebook's earlier cells left behind.
NAMESPACE: dict[str, Any] = {
    "threading": threading, "os": os, "subprocess": subprocess, "socket": socket,
    "pathlib": pathlib, "re": re, "itertools": itertools, "io": io,
    "path": "data.txt", "base": "/data", "rows": [1, 2, 3], "config": {"lr": 0.1},
    "text": "a1b22", "delay": 0, "names": ["a"],
    "Logger": Logger, "model": Opaque(), "helper": helper_without_source,
    "Lock": threading.Lock, "system": os.system,
}


def verdict(*cells: str, namespace: dict[str, Any] | None = None,
            definitions: dict[str, str] | None = None) -> Verdict:
    env = Namespace({**NAMESPACE, **(namespace or {})}, definitions)
    return check([_transform(cell) for cell in cells], env)


def definitions_of(*cells: str) -> dict[str, str]:
    """What capture records for the defs / lambdas of earlier cells."""
    found: dict[str, str] = {}
    for cell in cells:
        found.update(cellscan.scan(_transform(cell), {}).definitions)
    return found


# (id, cells, words the reason must contain)
HOSTILE: list[tuple[str, list[str], str]] = [
    ("appends to a log file",
     ["with open('run.log', 'a') as log:\n    log.write('started\\n')\nlock = threading.Lock()"],
     "writes files (open(..., 'a'))"),
    ("open for appending", ["open('x', 'a').write('y')"], "writes files"),
    ("open for writing, by keyword", ["fh = open('x', mode='w')"], "writes files"),
    ("open for updating", ["fh = open('x', 'r+')"], "writes files"),
    ("open exclusive", ["fh = open('x', 'xb')"], "writes files"),
    ("open with a mode from a variable", ["m = 'w'\nfh = open('x', m)"],
     "mode it cannot read"),
    ("open with unpacked arguments", ["args = ('x', 'w')\nfh = open(*args)"],
     "arguments it cannot read"),
    ("open on a file descriptor", ["fh = open(3)"], "cannot tell is a string"),
    ("io.open for writing", ["fh = io.open('x', 'w')"], "writes files"),
    ("open passed around", ["fhs = list(map(open, ['a'], ['w']))"], "as a value"),
    ("open renamed", ["o = open\nfh = o('x', 'w')"], "as a value"),
    ("pathlib write_text", ["pathlib.Path('x').write_text('y')"], "calls pathlib.Path"),
    ("pathlib imported", ["from pathlib import Path\nPath('x').write_text('y')"],
     "pathlib"),
    ("os.system", ["os.system('ls')"], "starts processes or threads (calls os.system)"),
    ("os.system imported earlier", ["system('ls')\nlock = threading.Lock()"], "os.system"),
    ("os.remove", ["os.remove('x')"], "may write files (calls os.remove)"),
    ("os.environ", ["os.environ.clear()"], "os.environ"),
    ("shutil", ["import shutil\nshutil.rmtree('d')"], "imports shutil"),
    ("subprocess.run", ["subprocess.run(['ls'])"], "starts processes"),
    ("socket.create_connection", ["s = socket.create_connection(('example.com', 80))"],
     "uses the network (calls socket.create_connection)"),
    ("urllib", ["import urllib.request\nr = urllib.request.urlopen('http://x')"],
     "imports urllib.request"),
    ("requests", ["import requests\nr = requests.get('http://x')"], "imports requests"),
    ("shell escape", ["!echo hi >> f"], "shell command or IPython magic"),
    ("shell escape bound", ["files = !ls"], "get_ipython().getoutput"),
    ("cell magic", ["%%bash\necho hi >> f\n"], "get_ipython().run_cell_magic"),
    ("line magic", ["%time gen = (i for i in range(3))"], "IPython magic"),
    ("get_ipython by hand", ["ip = get_ipython()\nip.system('ls')"], "IPython magic"),
    ("exec", ["exec('import os; os.remove(\"x\")')"], "calls exec, which can run any code"),
    ("eval", ["x = eval('1 + 1')"], "calls eval"),
    ("__import__", ["m = __import__('os')"], "__import__"),
    ("getattr trick", ["getattr(__builtins__, 'op' + 'en')('f', 'w')"], "getattr"),
    ("globals()", ["globals()['x'] = 1"], "calls globals"),
    ("subclass walk", ["k = ().__class__.__base__.__subclasses__()"], "private"),
    ("frame walk", ["g = (i for i in range(2))\nf = g.gi_frame.f_globals"],
     "an attribute of a value it cannot vet"),
    ("attrgetter", ["import operator\nf = operator.attrgetter('gi_frame')"], "attrgetter"),
    ("a function that writes, called later",
     ["log('x')\nlock = threading.Lock()"], "writes files"),
    ("a function that writes, defined in the cell",
     ["def save():\n    open('out.txt', 'w').write('x')\nlock = threading.Lock()"],
     "writes files"),
    ("a lambda that writes", ["save = lambda: open('out.txt', 'a')\nlock = threading.Lock()"],
     "writes files"),
    ("a lambda that writes, called at once", ["(lambda: os.remove('x'))()"], "os.remove"),
    ("a class whose __init__ writes",
     ["class Log:\n    def __init__(self):\n        open('log.txt', 'a').write('x')\n"
      "log = Log()"], "defines a class"),
    ("a class defined earlier", ["log = Logger()"], "a class whose methods it cannot vet"),
    ("a method of an unknown object", ["model.save('out.bin')\nlock = threading.Lock()"],
     "reads model (a "),
    ("a function without source", ["lock = helper()"], "whose source it does not have"),
    ("a decorator", ["import functools\n@functools.lru_cache\ndef f():\n    return 1"],
     "decorator"),
    ("with on an unknown context manager",
     ["import contextlib\nwith contextlib.ExitStack() as stack:\n    pass"],
     "contextlib.ExitStack"),
    ("with on a value", ["with rows:\n    pass"], "a context manager it cannot vet"),
    ("del", ["x = 1\ndel x"], "deletes"),
    ("del item", ["d = {}\ndel d['k']"], "deletes"),
    ("global", ["def f():\n    global count\n    count = 1\nf()"], "global"),
    ("nonlocal", ["def f():\n    n = 0\n    def g():\n        nonlocal n\n        n = 1"],
     "nonlocal"),
    ("module attribute set", ["threading.Lock = None"], "an attribute of a module"),
    ("module as a value", ["mods = [os]\nmods[0].remove('x')"], "the module os as a value"),
    ("bare except", ["try:\n    x = 1\nexcept:\n    pass"], "bare except"),
    ("catches BaseException", ["try:\n    x = 1\nexcept BaseException:\n    pass"],
     "catches BaseException"),
    ("catches KeyboardInterrupt in a tuple",
     ["try:\n    x = 1\nexcept (ValueError, KeyboardInterrupt):\n    pass"],
     "KeyboardInterrupt"),
    ("print to a file", ["print('x', file=names)"], "prints to a file"),
    ("import star", ["from os import *"], "imports * from os"),
    ("relative import", ["from . import mod"], "relative import"),
    ("async", ["async def f():\n    pass"], "async"),
    ("input", ["x = input()"], "calls input"),
    ("a missing name", ["x = undefined_thing + 1"], "not in the namespace"),
    ("annotation that calls", ["def f(x: open('a', 'w')):\n    return x"], "annotation"),
    ("dunder name", ["x = __name__"], "uses __name__"),
]


@pytest.mark.parametrize(("cells", "reason"), [(c, r) for _, c, r in HOSTILE],
                         ids=[i for i, _, _ in HOSTILE])
def test_hostile_cells_are_never_rerun(cells: list[str], reason: str) -> None:
    definitions = definitions_of(
        "def log(msg):\n    with open('log.txt', 'a') as out:\n        out.write(msg)")
    namespace = {"log": lambda msg: None}  # restored from the snapshot by value
    result = verdict(*cells, namespace=namespace, definitions=definitions)
    assert not result.safe
    assert reason in result.reason, result.reason


SAFE: list[tuple[str, list[str]]] = [
    ("a lock", ["lock = threading.Lock()"]),
    ("locks of every kind", ["import threading as th\na, b = th.RLock(), th.Event()\n"
                             "c = th.Condition()\nd = th.Semaphore(2)"]),
    ("a lock imported by name earlier", ["lock = Lock()"]),
    ("a file opened read-only", ["f = open('data.txt')"]),
    ("read-only modes", ["a = open('data.txt', 'r')\nb = open('data.txt', 'rb')\n"
                         "c = open(path, mode='rt', encoding='utf-8')"]),
    ("a file and its first line", ["fh = open('data.txt')\nfirst = fh.readline().strip()"]),
    ("a path built from strings", ["fh = open(os.path.join(base, 'data.txt'))\n"
                                   "gh = open(f'{base}/x.txt')\nhh = open(base + '/y')"]),
    ("with a file read-only", ["with open(path) as f:\n    lines = f.readlines()\n"
                               "it = iter(lines)"]),
    ("a generator", ["gen = (x for x in range(3))"]),
    ("a generator over data", ["gen = (row * 2 for row in rows if row)\nnext(gen)"]),
    ("a generator function", ["def squares(n):\n    for i in range(n):\n        yield i * i\n"
                              "gen = squares(5)"]),
    ("a regex", ["pattern = re.compile(r'\\d+')\nmatches = pattern.finditer(text)\n"
                 "first = next(matches).group()"]),
    ("a counter", ["import itertools\ncounter = itertools.count(start=1)"]),
    ("chained itertools", ["pairs = itertools.chain.from_iterable([rows, rows])"]),
    ("an in-memory buffer", ["buf = io.StringIO()\nbuf.write('x')\nprint('y', end='')"]),
    ("a function defined in the cell", ["def make():\n    return threading.Lock()\n"
                                        "lock = make()"]),
    ("a lambda", ["key = lambda r: -r\nordered = iter(sorted(rows, key=key))"]),
    ("catching ordinary exceptions",
     ["try:\n    fh = open('data.txt')\nexcept (OSError, ValueError) as error:\n"
      "    fh = None"]),
    ("a queue", ["import queue\nq = queue.Queue()\nq.put(1)"]),
    ("suppress", ["import contextlib\nwith contextlib.suppress(KeyError):\n"
                  "    v = config['x']\ngen = iter(config)"]),
    ("reads plain data", ["gen = iter(config.items())\nscale = config['lr'] * 2"]),
    ("sleeps", ["import time\ntime.sleep(delay)\nlock = threading.Lock()"]),
    ("x = x + 1 style", ["rows = rows + [4]\ngen = iter(rows)"]),
]


@pytest.mark.parametrize("cells", [c for _, c in SAFE], ids=[i for i, _ in SAFE])
def test_safe_cells_are_rerun(cells: list[str]) -> None:
    result = verdict(*cells)
    assert result.safe, result.reason


def test_a_function_from_an_earlier_cell_is_redefined_from_its_vetted_source() -> None:
    definitions = definitions_of("def make_lock():\n    return threading.Lock()",
                                 "double = lambda v: v * 2")
    namespace = {"make_lock": lambda: None, "double": lambda v: v}
    result = verdict("lock = make_lock()\ngen = map(double, rows)", namespace=namespace,
                     definitions=definitions)
    assert result.safe, result.reason
    # The replay runs the recorded source, not whatever object now has the name.
    assert sorted(result.program[:2]) == sorted(definitions.values())
    assert result.program[2] == "lock = make_lock()\ngen = map(double, rows)\n"
    assert set(result.inputs) == {"rows", "threading"}


def test_an_earlier_function_that_writes_is_refused_through_its_source() -> None:
    definitions = definitions_of("def setup():\n    os.makedirs('out')\n"
                                 "    return threading.Lock()")
    result = verdict("lock = setup()", namespace={"setup": lambda: None},
                     definitions=definitions)
    assert not result.safe and "os.makedirs" in result.reason


def test_a_module_name_rebound_to_an_object_is_refused() -> None:
    """Checked again at replay: ``threading`` may no longer be the module."""
    assert verdict("lock = threading.Lock()").safe
    result = verdict("lock = threading.Lock()", namespace={"threading": Opaque()})
    assert not result.safe and "reads threading (a " in result.reason


def test_inputs_are_the_vetted_names_only() -> None:
    result = verdict("fh = open(path)\nlock = threading.Lock()\ngen = iter(rows)")
    assert result.safe
    assert result.inputs == ("path", "rows", "threading")


@pytest.mark.parametrize(("value", "plain"), [
    (1, True), ("s", True), ([1, {"a": (2, 3.0)}], True), (b"x" * 10, True),
    ({1, 2}, True), (None, True), (range(3), True),
    (Opaque(), False), (threading.Lock(), False), ([1, Opaque()], False),
    (os, False), (print, False), (type("S", (str,), {})("x"), False),
    (list(range(200_000)), False),
])
def test_plain_data(value: object, plain: bool) -> None:
    assert is_plain(value) is plain


def test_numeric_arrays_are_plain_object_arrays_are_not() -> None:
    numpy = pytest.importorskip("numpy")
    assert is_plain(numpy.arange(10))
    assert not is_plain(numpy.array([Opaque()], dtype=object))


def test_syntax_error_is_not_rerun() -> None:
    assert not check(["def (:"], Namespace({})).safe
