"""HTTP routers of the control plane, one per resource."""
