"""State store: engine, migrations and sessions for the rsi state DB."""

from rsi.store.db import Store, open_store

__all__ = ["Store", "open_store"]
