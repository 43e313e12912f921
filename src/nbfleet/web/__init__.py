"""HTTP plumbing shared by the agent and the control plane (below both in the layers)."""
