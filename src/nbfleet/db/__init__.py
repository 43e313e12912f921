"""SQLAlchemy tables, sessions and migrations for the metadata DB."""
