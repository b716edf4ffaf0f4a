"""the gate's alpha-spending counter: one attempt number per (parent, candidate) pair

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 12:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('rsi_gate_attempts',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('lineage', sa.String(length=64), nullable=False),
    sa.Column('parent_pair_id', sa.String(length=64), nullable=False),
    sa.Column('candidate_pair_id', sa.String(length=64), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('generation', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['lineage'], ['rsi_lineages.name'],
                            name=op.f('fk_rsi_gate_attempts_lineage_rsi_lineages'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_gate_attempts')),
    sa.UniqueConstraint('lineage', 'parent_pair_id', 'candidate_pair_id', name=op.f('uq_rsi_gate_attempts_lineage')),
    sa.UniqueConstraint('attempt', 'parent_pair_id', 'lineage', name=op.f('uq_rsi_gate_attempts_attempt')),
    )
    op.create_index(op.f('ix_rsi_gate_attempts_lineage'), 'rsi_gate_attempts', ['lineage'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_rsi_gate_attempts_lineage'), table_name='rsi_gate_attempts')
    op.drop_table('rsi_gate_attempts')
