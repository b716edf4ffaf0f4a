"""failure attribution per generation

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 12:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('rsi_attributions',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('generation_id', sa.Integer(), nullable=False),
    sa.Column('level', sa.Integer(), nullable=False),
    sa.Column('task_id', sa.String(length=64), nullable=True),
    sa.Column('cause', sa.String(length=32), nullable=False),
    sa.Column('owner', sa.String(length=16), nullable=False),
    sa.Column('tasks', sa.Integer(), nullable=False),
    sa.Column('samples', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['generation_id'], ['rsi_generations.id'],
                            name=op.f('fk_rsi_attributions_generation_id_rsi_generations'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_attributions'))
    )
    op.create_index(op.f('ix_rsi_attributions_generation_id'), 'rsi_attributions', ['generation_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_rsi_attributions_generation_id'), table_name='rsi_attributions')
    op.drop_table('rsi_attributions')
