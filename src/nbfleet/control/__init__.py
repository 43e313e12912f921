"""Control plane: the public API, reconcilers and the kernel gateway."""
