"""Rate limits of the serving proxy shared by its workers: a token bucket row per key

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-12 12:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('rsi_rate_limits',
    sa.Column('api_key', sa.String(length=64), nullable=False),
    sa.Column('tokens', sa.Float(), nullable=False),
    sa.Column('updated', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('api_key', name=op.f('pk_rsi_rate_limits'))
    )


def downgrade() -> None:
    op.drop_table('rsi_rate_limits')
