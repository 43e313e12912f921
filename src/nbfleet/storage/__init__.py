"""Blob store and workspace files: the source of truth for user data."""
