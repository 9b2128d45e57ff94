"""Alembic environment: runs on the connection handed over by `registry.db.migrate`."""

from alembic import context

from registry.db import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
