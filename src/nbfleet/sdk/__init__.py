"""Client helpers for talking to nbfleet (used by the CLI, tests and benchmarks)."""
