"""Vetting statements for replay, and the passes over a whole program.

Statements that could change the world or hide from the walker (``del``,
``global``, classes, decorators, async code, ``match``) are refused outright, as
are exception handlers that could swallow the replay's timeout.
"""

from __future__ import annotations

import ast
import builtins
import types
from collections.abc import Sequence

from nbfleet.kernel.allowlist import (
    CALLABLE,
    CONTEXT_KINDS,
    DATA,
    FILE,
    FN,
    IMPORTABLE,
    MODULE,
    STR,
    UNCATCHABLE,
    Kind,
)
from nbfleet.kernel.vetexpr import (
    PENDING,
    STR_ITERABLE,
    ExpressionVetter,
    Scope,
    Unsafe,
    snippet,
)

MAX_PASSES = 4


class ProgramVetter(ExpressionVetter):
    """Infers the kind of every name (a few passes, to a fixed point), then walks the
    program once more refusing anything not allowed."""

    def run(self) -> None:
        for _ in range(MAX_PASSES):
            self.changed = False
            self._block(self.body, self.module)
            if not self.changed:
                break
        self.checking = True
        self._block(self.body, self.module)

    def _annotation(self, node: ast.expr, scope: Scope) -> None:
        """Annotations are evaluated when the def runs: only names, and attributes and
        subscripts of modules and built-in types, so that no user code runs."""
        for part in ast.walk(node):
            if not isinstance(part, _ANNOTATION_NODES):
                raise Unsafe(f"computes something in an annotation ({snippet(node)})")
            if isinstance(part, ast.Attribute) and part.attr.startswith("_"):
                raise Unsafe(f"uses the private attribute .{part.attr} ({snippet(node)})")
            if isinstance(part, ast.Name):
                self._annotation_name(part.id, scope)
            elif isinstance(part, ast.Attribute | ast.Subscript):
                root: ast.expr = part
                while isinstance(root, ast.Attribute | ast.Subscript):
                    root = root.value
                if not (isinstance(root, ast.Name) and self._is_typing_root(root.id, scope)):
                    raise Unsafe(f"computes something in an annotation ({snippet(node)})")

    def _annotation_name(self, name: str, scope: Scope) -> None:
        if name.startswith("__"):
            raise Unsafe(f"uses {name}")
        here: Scope | None = scope
        while here is not None:
            if name in here.local:
                return
            here = here.parent
        present, _ = self.env.lookup(name)
        if present:  # loading a name runs nothing; replay copies only plain data
            self.inputs.add(name)

    def _is_typing_root(self, name: str, scope: Scope) -> bool:
        """A module, or a built-in type (``list[int]``): subscripting a user class could
        run its ``__class_getitem__``."""
        here: Scope | None = scope
        while here is not None:
            if name in here.local:
                return here.kinds.get(name, "").startswith(MODULE)
            here = here.parent
        present, value = self.env.lookup(name)
        if not present:
            return isinstance(getattr(builtins, name, None), type)
        return isinstance(value, types.ModuleType) or (
            isinstance(value, type) and value.__module__ in _TYPING_MODULES)

    # -- statements ------------------------------------------------------------

    def _block(self, body: Sequence[ast.stmt], scope: Scope) -> None:
        for stmt in body:
            try:
                self._stmt(stmt, scope)
            except Unsafe:
                if self.checking:
                    raise

    def _target(self, node: ast.expr, kind: Kind, scope: Scope) -> None:
        if isinstance(node, ast.Name):
            self._bind(scope, node.id, kind)
        elif isinstance(node, ast.Tuple | ast.List):
            for element in node.elts:
                self._target(element, DATA, scope)
        elif isinstance(node, ast.Starred):
            self._target(node.value, DATA, scope)
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("_"):
                raise Unsafe(f"sets the private attribute .{node.attr}")
            root = self._eval(node.value, scope)
            if root.startswith((MODULE, FN)):
                raise Unsafe(f"changes {snippet(node)}, an attribute of a module")
            self._expr(node.value, scope)
        elif isinstance(node, ast.Subscript):
            self._expr(node.value, scope)
            self._expr(node.slice, scope)
        else:
            raise Unsafe(f"assigns to {snippet(node)}")

    def _stmt(self, node: ast.stmt, scope: Scope) -> None:
        if isinstance(node, ast.Expr):
            self._expr(node.value, scope)
        elif isinstance(node, ast.Assign):
            kind = self._expr(node.value, scope)
            for target in node.targets:
                self._target(target, kind, scope)
        elif isinstance(node, ast.AugAssign):
            self._expr(node.value, scope)
            if isinstance(node.target, ast.Name):
                self._expr(node.target, scope)
            self._target(node.target, DATA, scope)
        elif isinstance(node, ast.AnnAssign):
            self._annotation(node.annotation, scope)
            if node.value is not None:
                self._target(node.target, self._expr(node.value, scope), scope)
        elif isinstance(node, ast.For):
            source = self._expr(node.iter, scope)
            self._target(node.target, STR if source in STR_ITERABLE else DATA, scope)
            self._block([*node.body, *node.orelse], scope)
        elif isinstance(node, ast.While | ast.If):
            self._expr(node.test, scope)
            self._block([*node.body, *node.orelse], scope)
        elif isinstance(node, ast.With):
            for item in node.items:
                kind = self._expr(item.context_expr, scope)
                if kind not in CONTEXT_KINDS and (self.checking or kind != PENDING):
                    raise Unsafe(f"uses `with` on {snippet(item.context_expr)}, "
                                  "a context manager it cannot vet")
                if item.optional_vars is not None:
                    self._target(item.optional_vars, kind if kind == FILE else DATA, scope)
            self._block(node.body, scope)
        elif isinstance(node, ast.Try | ast.TryStar):
            self._try(node, scope)
        elif isinstance(node, ast.FunctionDef):
            if node.decorator_list:
                raise Unsafe(f"uses the decorator @{snippet(node.decorator_list[0])}, "
                              "which it cannot vet")
            self._function(node, scope)
            self._bind(scope, node.name, CALLABLE)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            self._import(node, scope)
        elif isinstance(node, ast.Return | ast.Raise | ast.Assert):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self._expr(child, scope)
        elif isinstance(node, ast.Pass | ast.Break | ast.Continue):
            pass
        else:
            raise Unsafe(_REFUSED.get(type(node), f"uses a {type(node).__name__} statement"))

    def _try(self, node: ast.Try | ast.TryStar, scope: Scope) -> None:
        self._block(node.body, scope)
        for handler in node.handlers:
            if handler.type is None:
                raise Unsafe("catches every exception (a bare except:), so a replay that "
                              "runs too long could not be stopped")
            for part in ast.walk(handler.type):
                if isinstance(part, ast.Name) and part.id in UNCATCHABLE:
                    raise Unsafe(f"catches {part.id}, so a replay that runs too long "
                                  "could not be stopped")
            self._expr(handler.type, scope)
            if handler.name:
                self._bind(scope, handler.name, DATA)
            self._block(handler.body, scope)
        self._block([*node.orelse, *node.finalbody], scope)

    def _import(self, node: ast.Import | ast.ImportFrom, scope: Scope) -> None:
        if isinstance(node, ast.ImportFrom):
            if node.level or node.module is None:
                raise Unsafe("uses a relative import")
            if node.module not in IMPORTABLE:
                raise Unsafe(f"imports {node.module}, which is not on the replay allowlist")
            for alias in node.names:
                if alias.name == "*":
                    raise Unsafe(f"imports * from {node.module}")
                kind = self._dotted(f"{node.module}.{alias.name}", verb="imports")
                self._bind(scope, alias.asname or alias.name, kind)
            return
        for alias in node.names:
            if alias.name not in IMPORTABLE:
                raise Unsafe(f"imports {alias.name}, which is not on the replay allowlist")
            top = alias.name.split(".")[0]
            bound = alias.name if alias.asname else top
            self._bind(scope, alias.asname or top, MODULE + bound)


_ANNOTATION_NODES = (ast.Name, ast.Attribute, ast.Constant, ast.Subscript, ast.Tuple, ast.List,
                     ast.BinOp, ast.BitOr, ast.expr_context)
_TYPING_MODULES = frozenset({"builtins", "typing", "collections.abc", "types"})

_REFUSED: dict[type, str] = {
    ast.Delete: "deletes names or items (del)",
    ast.Global: "declares global names",
    ast.Nonlocal: "declares nonlocal names",
    ast.ClassDef: "defines a class, whose methods are not vetted for replay",
    ast.AsyncFunctionDef: "uses async code",
    ast.AsyncFor: "uses async code",
    ast.AsyncWith: "uses async code",
    ast.Match: "uses a match statement, which it does not vet",
}
