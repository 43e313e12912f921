"""Per-host agent: runs kernels, reports inventory, obeys fenced commands."""
