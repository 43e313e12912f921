"""Pure scheduling policies, shared by the live scheduler and the simulator."""
