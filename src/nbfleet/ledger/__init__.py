"""Credit ledger (issue 5)."""
