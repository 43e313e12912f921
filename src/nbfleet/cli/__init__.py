"""The nbfleet command line."""
