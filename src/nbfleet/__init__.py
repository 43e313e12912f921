"""nbfleet: GPU-efficient hosted notebooks and GPU jobs."""

__version__ = "0.1.0"
