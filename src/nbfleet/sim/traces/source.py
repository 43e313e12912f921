"""One entry point for ``--trace`` arguments, so the CLI and benchmarks agree on names.

* ``synthetic:sensei`` -> ``synthetic.sensei(hours, seed)``
* ``synthetic:sensei-busy`` -> the same without the nearly idle sessions
  (``light_fraction=0``): closer to the concurrency of the paper's Figure 7
* ``synthetic:widetail`` -> ``widetail.widetail(hours, seed)``: a production-like
  month, a third of the tasks 8 GPUs wide, durations and think times heavy-tailed
* ``tiresias:PATH`` -> ``tiresias.read_tiresias(PATH, sessions=...)``
* ``native:PATH`` or a plain ``PATH`` -> ``native.read_native`` by extension, except
  that a plain ``.csv`` whose header starts with ``job_id`` is read as Tiresias.
"""

from __future__ import annotations

from pathlib import Path

from nbfleet.sim.traces.model import Trace, TraceError
from nbfleet.sim.traces.native import read_native
from nbfleet.sim.traces.synthetic import LIGHT_FRACTION, PAPER_HOURS, sensei
from nbfleet.sim.traces.tiresias import SessionMode, read_tiresias
from nbfleet.sim.traces.widetail import widetail

SYNTHETIC = ("sensei", "sensei-busy", "widetail")


def load_trace(spec: str, *, hours: float = PAPER_HOURS, seed: int = 0,
               tiresias_sessions: SessionMode = "infer") -> Trace:
    """Resolve a trace spec; ``hours`` and ``seed`` only apply to synthetic traces."""
    kind, sep, rest = spec.partition(":")
    if sep and kind == "synthetic":
        if rest not in SYNTHETIC:
            raise TraceError(f"unknown synthetic trace {rest!r}; known: {', '.join(SYNTHETIC)}")
        if rest == "widetail":
            return widetail(hours, seed)
        return sensei(hours, seed, light_fraction=0.0 if rest == "sensei-busy" else LIGHT_FRACTION)
    if sep and kind == "tiresias":
        return read_tiresias(rest, sessions=tiresias_sessions)
    if sep and kind == "native":
        return read_native(rest)
    path = Path(spec)
    if path.suffix.lower() == ".csv" and _looks_tiresias(path):
        return read_tiresias(path, sessions=tiresias_sessions)
    return read_native(path)


def _looks_tiresias(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8-sig") as handle:
            header = handle.readline()
    except OSError:
        return False
    return header.strip().lower().startswith("job_id")
