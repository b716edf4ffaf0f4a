"""Alembic environment and versions for the rsi state DB (shipped with the package)."""
