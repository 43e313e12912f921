"""Vetting expressions for replay: kinds of values, calls, attributes, functions.

Each value a replayed program handles has a *kind* (:mod:`nbfleet.kernel.allowlist`)
that says what may be done with it. The walker infers the kinds of names over a
few passes (a name may be used before the line that binds it, in a loop or a
function), then checks, refusing with :class:`Unsafe` whatever is not allowed.
Statements are in :mod:`nbfleet.kernel.vetstmt`.
"""

from __future__ import annotations

import ast
import builtins
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass

from nbfleet.kernel.allowlist import (
    ARGUMENT_CHECKED,
    ATTRIBUTES,
    CALLABLE,
    DATA,
    FILE,
    FN,
    IMPORTABLE,
    MIXED,
    MODULE,
    POISON,
    SAFE_CALLS,
    STR,
    STR_METHODS,
    Kind,
    module_name,
    why_not,
)
from nbfleet.kernel.names import bound_by_import
from nbfleet.kernel.vetvalues import Namespace, is_plain

PENDING: Kind = "pending"  # not inferred yet (a name bound later in the program)
_MAGIC = "runs a shell command or IPython magic"
_CONSTANTS = frozenset({"True", "False", "None", "Ellipsis", "NotImplemented"})
STR_ITERABLE = frozenset({STR, FILE})


class Unsafe(Exception):
    """The program may not be re-run; the message completes "the cell that made it ..."."""


class NeedDefinition(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def snippet(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_get_ipython(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "get_ipython")


def _bound_in(body: Sequence[ast.AST], params: Sequence[str] = ()) -> frozenset[str]:
    """Names a scope binds (nested functions, lambdas and comprehensions excluded,
    except for the walrus, which binds in the enclosing scope)."""
    names = set(params)
    todo = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
            names.update(n.target.id for n in ast.walk(node) if isinstance(n, ast.NamedExpr))
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update(bound_by_import(node))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        todo.extend(ast.iter_child_nodes(node))
    return frozenset(names)


def _params(args: ast.arguments) -> list[str]:
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    return [arg.arg for arg in every if arg is not None]


def join(a: Kind | None, b: Kind) -> Kind:
    """The kind of a name bound to values of kinds ``a`` and ``b``."""
    if a is None or a == PENDING:
        return b
    if b == PENDING or a == b:
        return a
    if {a, b} == {STR, DATA}:
        return DATA

    def callable_(kind: Kind) -> bool:
        return kind == CALLABLE or (kind.startswith(FN) and kind[len(FN):] not in ARGUMENT_CHECKED)

    if callable_(a) and callable_(b):
        return CALLABLE
    if POISON in (a, b) or a.startswith((MODULE, FN)) or b.startswith((MODULE, FN)):
        return POISON
    return MIXED


@dataclass
class Scope:
    parent: Scope | None
    local: frozenset[str]
    kinds: dict[str, Kind]
    comprehension: bool = False


class ExpressionVetter:
    """Kinds and checks for names and expressions; see :class:`vetstmt.ProgramVetter`."""

    def __init__(self, env: Namespace, trees: list[ast.Module]) -> None:
        self.env = env
        self.body: list[ast.stmt] = [stmt for tree in trees for stmt in tree.body]
        self.inputs: set[str] = set()
        self.checking = False
        self.changed = False
        self.scopes: dict[int, dict[str, Kind]] = {}
        local = _bound_in(self.body)
        kinds: dict[str, Kind] = {}
        for name in local:  # ``x = x + 1``: read before the program binds it
            kind = self._soft_outside(name)
            if kind is not None:
                kinds[name] = kind
        self.module = Scope(None, local, kinds)

    # -- names ---------------------------------------------------------------

    def _bind(self, scope: Scope, name: str, kind: Kind) -> None:
        if name.startswith("__"):
            raise Unsafe(f"binds {name}")
        old = scope.kinds.get(name)
        new = join(old, kind)
        if new != old:
            scope.kinds[name] = new
            self.changed = True

    def _lookup(self, name: str, scope: Scope) -> Kind:
        if name.startswith("__"):
            raise Unsafe(f"uses {name}")
        if name == "get_ipython":
            raise Unsafe(_MAGIC)
        here: Scope | None = scope
        while here is not None:
            if name in here.local:
                kind = here.kinds.get(name, PENDING)
                return MIXED if kind == PENDING and self.checking else kind
            here = here.parent
        return self._outside(name)

    def _soft_outside(self, name: str) -> Kind | None:
        present, _ = self.env.lookup(name)
        if not present:
            return None
        try:
            return self._outside(name)
        except (Unsafe, NeedDefinition):
            return None

    def _outside(self, name: str) -> Kind:
        """The kind of a name the program reads from the namespace (or builtins)."""
        present, value = self.env.lookup(name)
        if not present:
            if name in _CONSTANTS:
                return DATA
            if hasattr(builtins, name):
                dotted = f"builtins.{name}"
                if dotted in SAFE_CALLS:
                    return FN + dotted
                raise Unsafe(why_not(dotted))
            raise Unsafe(f"reads {name}, which is not in the namespace")
        kind = self._kind_of_value(name, value)
        self.inputs.add(name)
        return kind

    def _kind_of_value(self, name: str, value: object) -> Kind:
        if isinstance(value, types.ModuleType):
            if sys.modules.get(value.__name__) is value:
                return MODULE + module_name(value)
            raise Unsafe(f"uses {name}, a module that was not imported normally")
        dotted = self.env.known(value)
        if dotted is not None:
            return FN + dotted
        if isinstance(value, types.FunctionType):
            if name in self.env.definitions:
                raise NeedDefinition(name)
            raise Unsafe(f"calls {name}, a function whose source it does not have")
        if is_plain(value):
            return STR if isinstance(value, str | bytes) else DATA
        label = f"{type(value).__module__}.{type(value).__qualname__}"
        if isinstance(value, type):
            raise Unsafe(f"calls {name}, a class whose methods it cannot vet")
        if callable(value):
            owner = module_name(str(getattr(value, "__module__", None)))
            qualified = f"{owner}.{getattr(value, '__name__', name)}"
            raise Unsafe(why_not(qualified))
        raise Unsafe(f"reads {name} (a {label}), which it cannot vet")

    def _dotted(self, dotted: str, verb: str = "uses") -> Kind:
        """The kind of ``module.attr``: an allowlisted callable, a module, or a constant."""
        if dotted in SAFE_CALLS:
            return FN + dotted
        if dotted in IMPORTABLE:
            return MODULE + dotted
        module_path, _, attr = dotted.rpartition(".")
        module = sys.modules.get(module_path) if module_path in IMPORTABLE else None
        if module is not None and not attr.startswith("_"):
            value = getattr(module, attr, None)
            if (value is not None and not callable(value)
                    and not isinstance(value, types.ModuleType) and is_plain(value, strict=False)):
                return STR if isinstance(value, str | bytes) else DATA
        raise Unsafe(why_not(dotted).replace("calls", verb, 1) if verb != "calls"
                      else why_not(dotted))

    # -- expressions -----------------------------------------------------------

    def _expr(self, node: ast.expr, scope: Scope) -> Kind:
        """The kind of an expression used as a value (passed, stored, returned)."""
        kind = self._eval(node, scope)
        if kind.startswith(MODULE):
            raise Unsafe(f"uses the module {kind[len(MODULE):]} as a value")
        if kind == POISON:
            raise Unsafe(f"binds {snippet(node)} to values of different kinds")
        if kind.startswith(FN) and kind[len(FN):] in ARGUMENT_CHECKED:
            short = kind[len(FN):].removeprefix("builtins.")
            raise Unsafe(f"passes {short} around as a value, so its arguments cannot be checked")
        return kind

    def _eval(self, node: ast.expr, scope: Scope) -> Kind:
        if isinstance(node, ast.Name):
            return self._lookup(node.id, scope)
        if isinstance(node, ast.Attribute):
            if _is_get_ipython(node.value):
                raise Unsafe(f"{_MAGIC} (get_ipython().{node.attr})")
            return self._attribute(self._eval(node.value, scope), node.attr, node)
        if isinstance(node, ast.Call):
            return self._call(node, scope)
        if isinstance(node, ast.Constant):
            return STR if isinstance(node.value, str | bytes) else DATA
        if isinstance(node, ast.JoinedStr):
            for value in node.values:
                self._expr(value, scope)
            return STR
        if isinstance(node, ast.FormattedValue):
            self._expr(node.value, scope)
            if node.format_spec is not None:
                self._expr(node.format_spec, scope)
            return STR
        if isinstance(node, ast.BinOp):
            left, right = self._expr(node.left, scope), self._expr(node.right, scope)
            strings = isinstance(node.op, ast.Add | ast.Mod | ast.Mult) and STR in (left, right)
            return STR if strings else DATA
        if isinstance(node, ast.BoolOp | ast.IfExp):
            parts = node.values if isinstance(node, ast.BoolOp) else [node.body, node.orelse]
            if isinstance(node, ast.IfExp):
                self._expr(node.test, scope)
            kind: Kind = PENDING
            for part in parts:
                kind = join(kind, self._expr(part, scope))
            return kind
        if isinstance(node, ast.NamedExpr):
            kind = self._expr(node.value, scope)
            target = scope
            while target.comprehension and target.parent is not None:
                target = target.parent
            self._bind(target, node.target.id, kind)
            return kind
        if isinstance(node, ast.Lambda):
            self._function(node, scope)
            return CALLABLE
        if isinstance(node, ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
            self._comprehension(node, scope)
            return DATA
        if isinstance(node, ast.Await):
            raise Unsafe("uses await")
        if isinstance(node, ast.UnaryOp | ast.Compare | ast.Dict | ast.List | ast.Set
                      | ast.Tuple | ast.Starred | ast.Subscript | ast.Slice | ast.Yield
                      | ast.YieldFrom):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self._expr(child, scope)
            return DATA
        raise Unsafe(f"uses {type(node).__name__} syntax, which it does not vet")

    def _attribute(self, root: Kind, attr: str, node: ast.AST) -> Kind:
        """The kind of ``<value of kind root>.attr`` (not called)."""
        if attr.startswith("_"):
            raise Unsafe(f"uses the private attribute .{attr} ({snippet(node)})")
        if root.startswith(MODULE):
            return self._dotted(f"{root[len(MODULE):]}.{attr}")
        if root.startswith(FN) and f"{root[len(FN):]}.{attr}" in SAFE_CALLS:
            return f"{root}.{attr}"
        if root == PENDING:
            return PENDING
        if attr not in ATTRIBUTES.get(root, frozenset()):
            raise Unsafe(f"uses {snippet(node)}, an attribute of a value it cannot vet")
        return DATA

    def _call(self, node: ast.Call, scope: Scope) -> Kind:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "get_ipython":
            raise Unsafe(_MAGIC)
        if isinstance(func, ast.Attribute):
            if _is_get_ipython(func.value):
                raise Unsafe(f"{_MAGIC} (get_ipython().{func.attr})")
            if func.attr.startswith("_"):
                raise Unsafe(f"calls the private method {snippet(func)}")
            receiver = self._eval(func.value, scope)
            if not receiver.startswith((MODULE, FN)):
                return self._method(receiver, func, node, scope)
            callee = self._dotted(f"{receiver.split(':', 1)[1]}.{func.attr}", verb="calls")
        else:
            callee = self._eval(func, scope)
        self._arguments(node, scope)
        if callee.startswith(FN):
            dotted = callee[len(FN):]
            if dotted == "builtins.print" and any(kw.arg in (None, "file")
                                                  for kw in node.keywords):
                raise Unsafe("prints to a file (print(file=...))")
            if dotted in ("builtins.open", "io.open"):
                self._open(node, scope)
            return SAFE_CALLS[dotted]
        if callee == CALLABLE:
            return DATA
        if callee == PENDING and not self.checking:
            return PENDING
        if callee.startswith(MODULE):
            raise Unsafe(f"calls the module {callee[len(MODULE):]}")
        raise Unsafe(f"calls {snippet(func)}, which it cannot vet")

    def _method(self, receiver: Kind, func: ast.Attribute, node: ast.Call, scope: Scope) -> Kind:
        self._arguments(node, scope)
        if receiver == PENDING and not self.checking:
            return PENDING
        if func.attr not in ATTRIBUTES.get(receiver, frozenset()):
            raise Unsafe(f"calls {snippet(func)}(), a method of a value it cannot vet")
        return STR if receiver in STR_ITERABLE and func.attr in STR_METHODS else DATA

    def _arguments(self, node: ast.Call, scope: Scope) -> None:
        for arg in node.args:
            self._expr(arg, scope)
        for keyword in node.keywords:
            self._expr(keyword.value, scope)

    def _open(self, node: ast.Call, scope: Scope) -> None:
        """open() only for reading, with a literal mode and a name that is a string."""
        if (any(isinstance(arg, ast.Starred) for arg in node.args)
                or any(kw.arg is None for kw in node.keywords)):
            raise Unsafe(f"opens a file with arguments it cannot read ({snippet(node)})")
        named = {kw.arg: kw.value for kw in node.keywords}
        if "opener" in named:
            raise Unsafe("opens a file through an opener function")
        file = node.args[0] if node.args else named.get("file")
        mode = node.args[1] if len(node.args) > 1 else named.get("mode")
        if mode is not None:
            if not (isinstance(mode, ast.Constant) and isinstance(mode.value, str)):
                raise Unsafe(f"opens a file in a mode it cannot read from the source "
                              f"({snippet(node)})")
            if set(mode.value) - set("rbt"):
                raise Unsafe(f"writes files (open(..., {mode.value!r}))")
        kind = self._expr(file, scope) if file is not None else DATA
        if kind != STR and (self.checking or kind != PENDING):
            # An int would open a file descriptor the kernel already uses, and close it.
            raise Unsafe(f"opens a file whose name it cannot tell is a string "
                          f"({snippet(node)})")

    def _function(self, node: ast.FunctionDef | ast.Lambda, scope: Scope) -> None:
        args = node.args
        for default in [*args.defaults, *args.kw_defaults]:
            if default is not None:
                self._expr(default, scope)
        if isinstance(node, ast.FunctionDef):
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            for annotation in [*(a.annotation for a in every if a is not None), node.returns]:
                if annotation is not None:
                    self._annotation(annotation, scope)
        params = _params(args)
        body: list[ast.AST] = [node.body] if isinstance(node, ast.Lambda) else list(node.body)
        kinds = self.scopes.setdefault(id(node), dict.fromkeys(params, DATA))
        inner = Scope(scope, _bound_in(body, params), kinds)
        if isinstance(node, ast.Lambda):
            self._expr(node.body, inner)
        else:
            self._block(node.body, inner)

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp,
                       scope: Scope) -> None:
        first = self._expr(node.generators[0].iter, scope)  # evaluated outside
        targets = [gen.target for gen in node.generators]
        local = frozenset(n.id for target in targets for n in ast.walk(target)
                          if isinstance(n, ast.Name))
        inner = Scope(scope, local, self.scopes.setdefault(id(node), {}), comprehension=True)
        for index, gen in enumerate(node.generators):
            if gen.is_async:
                raise Unsafe("uses async code")
            source = first if index == 0 else self._expr(gen.iter, inner)
            self._target(gen.target, STR if source in STR_ITERABLE else DATA, inner)
            for condition in gen.ifs:
                self._expr(condition, inner)
        elements = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        for element in elements:
            self._expr(element, inner)

    def _block(self, body: Sequence[ast.stmt], scope: Scope) -> None:
        raise NotImplementedError  # statements: vetstmt.ProgramVetter

    def _annotation(self, node: ast.expr, scope: Scope) -> None:
        raise NotImplementedError  # vetstmt.ProgramVetter

    def _target(self, node: ast.expr, kind: Kind, scope: Scope) -> None:
        raise NotImplementedError  # vetstmt.ProgramVetter
