"""Contracts between the control plane, the agents and the kernels, declared once.

Both sides import these models, so a field renamed on one side is a type error on
the other instead of a silent ``None``. This is the bottom layer: it imports
nothing from nbfleet.
"""
