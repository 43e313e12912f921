"""Whether the cells that made an unpicklable value may be re-run on resume.

Re-running a cell repeats everything it did, so a cell is replayed only when its
source shows that it cannot do anything outside the kernel's memory: every call
it makes (function bodies and lambdas included, whether or not they run) is on
the allowlist of :mod:`nbfleet.kernel.allowlist`, a function the cells
themselves defined (and vetted the same way), or a method of a value whose kind
is known. Anything else (a write, a process, the network, a magic, ``exec``, a
method of an object it cannot see into, a ``with`` on an unknown context
manager, ``del``, ``global``, a class, a decorator) makes the whole recipe
unsafe, and the value is reported lost with the reason.

The check runs twice: when the snapshot is written (so the manifest only holds
safe recipes) and again right before a replay, against the namespace the replay
will see, because a name may since have been bound to something else. Values a
recipe reads from the namespace are limited to modules, allowlisted callables
and plain data (built-in types and numeric arrays, copied for the replay), and
a user function it calls is re-defined from its recorded, vetted source instead
of trusting the object in the namespace.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass

from nbfleet.kernel.vetexpr import NeedDefinition, Unsafe
from nbfleet.kernel.vetstmt import ProgramVetter
from nbfleet.kernel.vetvalues import Namespace, is_plain

__all__ = ["Namespace", "Verdict", "check", "is_plain", "not_rerun"]

MAX_DEFINITIONS = 20


@dataclass(frozen=True)
class Verdict:
    """``reason`` is empty when the program is safe to re-run."""

    reason: str
    program: tuple[str, ...] = ()
    """The sources to execute: the recipe's cells after the definitions they call."""
    inputs: tuple[str, ...] = ()
    """Names the program reads from the namespace (all vetted)."""

    @property
    def safe(self) -> bool:
        return not self.reason


def not_rerun(reason: str) -> str:
    """The user-facing sentence for a value whose recipe was refused."""
    return f"the cell that made it {reason}, so it is not re-run on resume"


def check(sources: Sequence[str], env: Namespace) -> Verdict:
    """Vet ``sources`` (cells run in order) against ``env``."""
    prepended: list[str] = []
    while True:
        program = [*prepended, *sources]
        try:
            trees = [ast.parse(source) for source in program]
        except (SyntaxError, ValueError):
            return Verdict("does not parse")
        analysis = ProgramVetter(env, trees)
        try:
            analysis.run()
        except NeedDefinition as need:
            definition = env.definitions.get(need.name)
            if definition is None or not _defines(definition, need.name):
                return Verdict(f"calls {need.name}, a function whose source it does not have")
            if len(prepended) >= MAX_DEFINITIONS:
                return Verdict(f"calls more than {MAX_DEFINITIONS} functions defined elsewhere")
            prepended.append(definition)
            continue
        except Unsafe as error:
            return Verdict(str(error))
        except RecursionError:
            return Verdict("is nested too deeply to vet")
        return Verdict("", tuple(program), tuple(sorted(analysis.inputs)))


def _defines(source: str, name: str) -> bool:
    """A recorded definition is exactly one ``def name`` or ``name = lambda ...``."""
    try:
        body = ast.parse(source).body
    except (SyntaxError, ValueError):
        return False
    if len(body) != 1:
        return False
    node = body[0]
    if isinstance(node, ast.FunctionDef):
        return node.name == name
    return (isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name
            and isinstance(node.value, ast.Lambda))
