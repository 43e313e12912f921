"""Pure domain: no I/O, no wall clock. The simulator and the live platform share it."""
