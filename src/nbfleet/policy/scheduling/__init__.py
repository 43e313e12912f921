"""Placement policies that the simulator and the live scheduler share."""
