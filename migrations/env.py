"""Alembic environment: runs with the connection rsi hands over in ``config.attributes``."""

from alembic import context

from rsi.store.schema import VERSION_TABLE, Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    raise SystemExit("run migrations through `rsi db upgrade`, which supplies the database connection")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
