"""trajectory tool log (episodes on the action substrate)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 19:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('rsi_trajectories') as batch:
        batch.add_column(sa.Column('tool_log', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('rsi_trajectories') as batch:
        batch.drop_column('tool_log')
