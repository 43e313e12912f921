"""JupyterLab for each workspace at ``/w/{id}/lab``: the unchanged frontend from the
jupyterlab package, and the Jupyter Server REST surface it calls, in the control plane
(no server process per user: see docs/decisions.md)."""
