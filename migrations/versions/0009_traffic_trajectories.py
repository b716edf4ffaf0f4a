"""traffic becomes experience: a trajectory harvested from a served conversation names it; a key opts out

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 22:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('rsi_trajectories') as batch:
        batch.add_column(sa.Column('conversation_id', sa.String(length=64), nullable=True))
        batch.create_index('ix_rsi_trajectories_conversation_id', ['conversation_id'])
    with op.batch_alter_table('rsi_api_keys') as batch:
        batch.add_column(sa.Column('harvest', sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    with op.batch_alter_table('rsi_api_keys') as batch:
        batch.drop_column('harvest')
    with op.batch_alter_table('rsi_trajectories') as batch:
        batch.drop_index('ix_rsi_trajectories_conversation_id')
        batch.drop_column('conversation_id')
