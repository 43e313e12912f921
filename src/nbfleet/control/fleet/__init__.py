"""The live fleet: the scheduling policy run against real hosts, and the hosts themselves."""
