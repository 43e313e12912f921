"""Which names a cell binds, mutates, deletes and reads, from its source alone.

This is a conservative over-approximation: capture re-pickles every name that
a cell *may* have changed, so a false positive costs a little CPU in the
background worker while a false negative would lose data on resume. Runtime
effects that no AST can see (``exec``, magics, ``globals()[...] =``) are
caught by the namespace diff in :mod:`nbfleet.kernel.capture` instead.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field

from nbfleet.kernel.names import bound_by_import, free_names, import_bindings

__all__ = ["CellScan", "bound_by_import", "import_bindings", "scan"]



@dataclass(frozen=True)
class CellScan:
    """What one cell does to the module-level namespace."""

    defined: frozenset[str] = frozenset()
    mutated: frozenset[str] = frozenset()
    deleted: frozenset[str] = frozenset()
    loaded: frozenset[str] = frozenset()
    imports: tuple[str, ...] = ()
    functions: Mapping[str, frozenset[str]] = field(default_factory=dict)
    uses_magic: bool = False
    definitions: Mapping[str, str] = field(default_factory=dict)
    """Source of each ``def f`` / ``f = lambda ...`` at module level: a later cell's
    replay re-defines the function from it (see :mod:`nbfleet.kernel.purity`)."""
    iterated: frozenset[str] = frozenset()
    """Names iterated over (``for x in it``): an iterator among them was consumed."""
    settings: tuple[str, ...] = ()
    """Top-level calls that configure the kernel rather than compute a value
    (``%matplotlib inline``, ``init_printing()``): replayed on resume."""


def scan(source: str, footprints: Mapping[str, frozenset[str]]) -> CellScan:
    """Analyse a (transformed) cell; a cell that does not parse gives an empty scan."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # ValueError: source with NUL bytes
        return CellScan()
    visitor = _ModuleScope()
    for stmt in tree.body:
        visitor.visit(stmt)
    known = {**footprints, **visitor.functions}
    functions = {name: _close_over(fp, known) for name, fp in visitor.functions.items()}
    known.update(functions)
    mutated = set(visitor.mutated)
    for called in visitor.called:
        mutated |= known.get(called, frozenset())
    return CellScan(
        defined=frozenset(visitor.defined),
        mutated=frozenset(mutated),
        deleted=frozenset(visitor.deleted),
        loaded=frozenset(visitor.loaded),
        imports=tuple(visitor.imports),
        functions=functions,
        uses_magic=_calls_get_ipython(tree),
        definitions={name: source for name, source in visitor.definitions.items()
                     if source is not None},
        iterated=frozenset(visitor.iterated),
        settings=tuple(ast.unparse(stmt) for stmt in tree.body if _is_setting(stmt)),
    )


#: Calls whose effect is kernel configuration (display formatters), not a value.
SETTING_CALLS = frozenset({"init_printing", "init_session"})
#: Line magics that configure the kernel and are replayed as they were typed.
SETTING_MAGICS = frozenset({"matplotlib", "autoreload", "xmode"})


def _is_setting(stmt: ast.stmt) -> bool:
    if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call):
        return False
    call = stmt.value
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name in SETTING_CALLS:
        return True
    return (name == "run_line_magic" and isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Call) and _calls_get_ipython(func.value)
            and bool(call.args) and isinstance(call.args[0], ast.Constant)
            and call.args[0].value in SETTING_MAGICS)


def _root(node: ast.expr) -> str | None:
    """The variable at the base of ``x.a[1].b`` / ``*x``: mutating the part mutates it."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Starred):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _close_over(footprint: frozenset[str], known: Mapping[str, frozenset[str]]) -> frozenset[str]:
    """A function touches what the functions it calls touch (transitively)."""
    seen = set(footprint)
    todo = [name for name in footprint if name in known]
    while todo:
        for name in known[todo.pop()]:
            if name not in seen:
                seen.add(name)
                if name in known:
                    todo.append(name)
    return frozenset(seen)


def _calls_get_ipython(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "get_ipython"
        for node in ast.walk(tree)
    )


class _ModuleScope(ast.NodeVisitor):
    """Walks statements that run at module scope, collecting name effects."""

    def __init__(self) -> None:
        self.defined: set[str] = set()
        self.mutated: set[str] = set()
        self.deleted: set[str] = set()
        self.loaded: set[str] = set()
        self.called: set[str] = set()
        self.iterated: set[str] = set()
        self.imports: list[str] = []
        self.functions: dict[str, frozenset[str]] = {}
        # None: bound more than once by the cell, so which source made it is unknown.
        self.definitions: dict[str, str | None] = {}
        # Names bound by enclosing comprehensions, mapped to the names their
        # iterables came from: mutating ``x`` in ``[x.pop() for x in rows]`` mutates ``rows``.
        self._comp_scopes: list[dict[str, frozenset[str]]] = []

    # -- names ---------------------------------------------------------------

    def _comp_sources(self, name: str) -> frozenset[str] | None:
        for scope in reversed(self._comp_scopes):
            if name in scope:
                return scope[name]
        return None

    def _mutate(self, name: str | None) -> None:
        if name is None:
            return
        sources = self._comp_sources(name)
        if sources is None:
            self.mutated.add(name)
        else:
            self.mutated |= sources

    def visit_Name(self, node: ast.Name) -> None:
        if self._comp_sources(node.id) is not None:
            return
        if isinstance(node.ctx, ast.Store):
            self.defined.add(node.id)
        elif isinstance(node.ctx, ast.Del):
            self.deleted.add(node.id)
        else:
            self.loaded.add(node.id)

    def _visit_part(self, node: ast.Attribute | ast.Subscript) -> None:
        if not isinstance(node.ctx, ast.Load):
            self._mutate(_root(node))
        self.generic_visit(node)

    visit_Attribute = _visit_part
    visit_Subscript = _visit_part

    def visit_Starred(self, node: ast.Starred) -> None:
        self.visit(node.value)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        # A walrus binds in the enclosing function scope even inside a comprehension.
        self.defined.add(node.target.id)
        self.visit(node.value)

    def _define(self, name: str, node: ast.AST) -> None:
        self.definitions[name] = None if name in self.definitions else ast.unparse(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if (len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Lambda)):
            self._define(node.targets[0].id, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name):
            self.loaded.add(node.target.id)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.annotation)
        if node.value is not None:  # ``x: int`` alone binds nothing
            self.visit(node.value)
            self.visit(node.target)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name):
            self.called.add(node.func.id)
        else:  # ``x.m()`` / ``x.a.m()`` / ``x[0].m()`` may change x
            self._mutate(_root(node.func))
        for arg in [*node.args, *(kw.value for kw in node.keywords)]:
            self._mutate(_root(arg))
        self.generic_visit(node)

    # -- statements ----------------------------------------------------------

    def _iterate(self, node: ast.expr) -> None:
        root = _root(node)
        if root is not None:
            sources = self._comp_sources(root)
            self.iterated |= {root} if sources is None else sources

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self._iterate(node.iter)
        self.visit(node.iter)
        self.visit(node.target)
        outer, self.mutated = self.mutated, set()
        for stmt in [*node.body, *node.orelse]:
            self.visit(stmt)
        inner, self.mutated = self.mutated, outer
        self.mutated |= inner
        # ``for row in rows: row.append(1)`` changes ``rows``.
        targets = {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        if targets & inner:
            self.mutated |= {n.id for n in ast.walk(node.iter) if isinstance(n, ast.Name)}

    visit_AsyncFor = visit_For

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        self.defined.update(bound_by_import(node))
        statement = ast.unparse(node)
        if statement not in self.imports:
            self.imports.append(statement)

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        # ``except E as e`` unbinds ``e`` at the end of the handler.
        if node.type is not None:
            self.visit(node.type)
        for stmt in node.body:
            self.visit(stmt)

    def visit_Global(self, node: ast.Global | ast.Nonlocal) -> None:
        return

    visit_Nonlocal = visit_Global

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        if node.name is not None:
            self.defined.add(node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        if node.name is not None:
            self.defined.add(node.name)

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        if node.rest is not None:
            self.defined.add(node.rest)
        self.generic_visit(node)

    # -- nested scopes -------------------------------------------------------

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        # Decorators, defaults and annotations run now; the body runs later.
        for expr in [*node.decorator_list, *node.args.defaults]:
            self.visit(expr)
        for default in node.args.kw_defaults:
            if default is not None:
                self.visit(default)
        self.defined.add(node.name)
        self.functions[node.name] = frozenset(free_names(node))
        if isinstance(node, ast.FunctionDef) and not self._comp_scopes:
            self._define(node.name, node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        self.loaded |= free_names(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *(kw.value for kw in node.keywords)]:
            self.visit(expr)
        # The body runs now but binds class attributes: keep only its effects
        # on names that are not class-local.
        inner = _ModuleScope()
        inner._comp_scopes = self._comp_scopes
        for stmt in node.body:
            inner.visit(stmt)
        local = inner.defined | inner.deleted | set(inner.functions)
        self.mutated |= inner.mutated - local
        self.loaded |= inner.loaded - local
        self.called |= inner.called - local
        self.defined.add(node.name)

    def _visit_comprehension(
        self, node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp
    ) -> None:
        scope: dict[str, frozenset[str]] = {}
        # The first iterable is evaluated in the enclosing scope.
        self._iterate(node.generators[0].iter)
        self.visit(node.generators[0].iter)
        self._comp_scopes.append(scope)
        try:
            for index, gen in enumerate(node.generators):
                if index:
                    self.visit(gen.iter)
                flat: set[str] = set()
                for name in ast.walk(gen.iter):
                    if isinstance(name, ast.Name):
                        found = self._comp_sources(name.id)
                        flat |= {name.id} if found is None else found
                for target in ast.walk(gen.target):
                    if isinstance(target, ast.Name):
                        scope[target.id] = frozenset(flat)
                for cond in gen.ifs:
                    self.visit(cond)
            elements = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            for element in elements:
                self.visit(element)
        finally:
            self._comp_scopes.pop()

    visit_ListComp = _visit_comprehension
    visit_SetComp = _visit_comprehension
    visit_DictComp = _visit_comprehension
    visit_GeneratorExp = _visit_comprehension
