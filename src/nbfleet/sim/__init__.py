"""Discrete-event simulator (issue 3)."""
