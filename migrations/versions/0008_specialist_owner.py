"""tenant-private specialists: the API key (by name) a specialist is private to

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 19:20:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('rsi_specialists') as batch:
        batch.add_column(sa.Column('owner_key', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('rsi_specialists') as batch:
        batch.drop_column('owner_key')
