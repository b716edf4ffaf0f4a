"""harness lock table, lease fencing token

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 23:50:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('rsi_harnesses',
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('hash', sa.String(length=64), nullable=False),
    sa.Column('document', sa.JSON(), nullable=False),
    sa.Column('sources', sa.JSON(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_harnesses'))
    )
    with op.batch_alter_table('rsi_leases') as batch:
        batch.add_column(sa.Column('token', sa.Integer(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('rsi_leases') as batch:
        batch.drop_column('token')
    op.drop_table('rsi_harnesses')
