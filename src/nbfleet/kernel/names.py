"""Name binding rules shared by the cell scanner: what an import binds, and
which global names a function body may touch when it eventually runs."""

from __future__ import annotations

import ast

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def bound_by_import(stmt: ast.Import | ast.ImportFrom) -> list[str]:
    """Names an import statement binds (``import a.b`` binds ``a``; ``*`` binds none we know)."""
    names = []
    for alias in stmt.names:
        if alias.name == "*":
            continue
        names.append(alias.asname or alias.name.split(".")[0])
    return names


def import_bindings(statement: str) -> list[str]:
    """``bound_by_import`` for an unparsed import statement (empty if it is not one)."""
    try:
        node = ast.parse(statement).body[0]
    except (SyntaxError, IndexError):
        return []
    return bound_by_import(node) if isinstance(node, ast.Import | ast.ImportFrom) else []


_ScopeNode = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef


def free_names(scope: _ScopeNode) -> set[str]:
    """Global names a function (or lambda) body may read or write when it runs.

    Over-approximates: any name not bound locally is treated as global, and
    names declared ``global`` count even if only assigned.
    """
    bound: set[str] = set()
    if not isinstance(scope, ast.ClassDef):
        args = scope.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None:
                bound.add(arg.arg)
    body: list[ast.AST] = [scope.body] if isinstance(scope, ast.Lambda) else list(scope.body)
    used: set[str] = set()
    declared_global: set[str] = set()
    nested: list[_ScopeNode] = []
    todo = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Global | ast.Nonlocal):
            declared_global.update(node.names)
        elif isinstance(node, ast.Name):
            used.add(node.id)
            if not isinstance(node.ctx, ast.Load):
                bound.add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update(bound_by_import(node))
        elif isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
            bound.add(node.name)
            nested.append(node)
            todo.extend(node.decorator_list)
            continue
        elif isinstance(node, ast.Lambda):
            nested.append(node)
            continue
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        todo.extend(ast.iter_child_nodes(node))
    free = (used - bound) | declared_global
    for child in nested:
        free |= free_names(child) - (bound - declared_global)
    return free
