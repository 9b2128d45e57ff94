"""tenants, API keys and the audit log

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("adapter_names", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenant", sa.String(length=64), nullable=False, server_default=""))
    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenant", sa.String(length=64), nullable=False, server_default=""))
        batch_op.add_column(sa.Column("public", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.create_index(batch_op.f("ix_adapters_tenant"), ["tenant"], unique=False)
    op.create_table(
        "api_keys",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("key_id", sa.String(length=16), nullable=False),
        sa.Column("secret_sha256", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key_id"),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("key_id", sa.String(length=16), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("target", sa.String(length=256), nullable=False),
        sa.Column("outcome", sa.String(length=32), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("audit_log")
    op.drop_table("api_keys")
    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_adapters_tenant"))
        batch_op.drop_column("public")
        batch_op.drop_column("tenant")
    with op.batch_alter_table("adapter_names", schema=None) as batch_op:
        batch_op.drop_column("tenant")
