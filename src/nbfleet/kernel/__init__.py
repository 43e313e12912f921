"""Code loaded inside user kernels (issue 4)."""
