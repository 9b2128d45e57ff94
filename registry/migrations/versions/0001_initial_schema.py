"""initial schema

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapter_events",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("base_model", sa.String(length=128), nullable=False),
        sa.Column("adapter_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("adapter_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_adapter_events_base_model"), ["base_model"], unique=False)

    op.create_table(
        "base_models",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "adapter_names",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("base_model_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("last_version", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["base_model_id"],
            ["base_models.id"],
        ),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "adapters",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("base_model_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("scaling", sa.Float(), nullable=False),
        sa.Column("target_modules", sa.Text(), nullable=False),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("labels_json", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["base_model_id"],
            ["base_models.id"],
        ),
        sa.ForeignKeyConstraint(
            ["name"],
            ["adapter_names.name"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name", "version", name="uq_adapters_name_version"),
    )
    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_adapters_base_model_id"), ["base_model_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_adapters_digest"), ["digest"], unique=False)
        batch_op.create_index(batch_op.f("ix_adapters_name"), ["name"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_adapters_name"))
        batch_op.drop_index(batch_op.f("ix_adapters_digest"))
        batch_op.drop_index(batch_op.f("ix_adapters_base_model_id"))

    op.drop_table("adapters")
    op.drop_table("adapter_names")
    op.drop_table("base_models")
    with op.batch_alter_table("adapter_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_adapter_events_base_model"))

    op.drop_table("adapter_events")
