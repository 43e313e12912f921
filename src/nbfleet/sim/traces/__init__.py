"""Trace input for the simulator: native JSONL/CSV, Tiresias CSV, synthetic SenseiTrace."""

from nbfleet.sim.traces.model import Session, Task, Trace, TraceError
from nbfleet.sim.traces.native import read_csv, read_jsonl, read_native, write_csv, write_jsonl
from nbfleet.sim.traces.source import load_trace
from nbfleet.sim.traces.synthetic import sensei
from nbfleet.sim.traces.tiresias import read_tiresias

__all__ = [
    "Session",
    "Task",
    "Trace",
    "TraceError",
    "load_trace",
    "read_csv",
    "read_jsonl",
    "read_native",
    "read_tiresias",
    "sensei",
    "write_csv",
    "write_jsonl",
]
