"""Mixture-of-LoRA serving: specialists, API keys, conversations

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05 12:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('rsi_specialists',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('lineage', sa.String(length=64), nullable=False),
    sa.Column('description', sa.Text(), nullable=False),
    sa.Column('levels', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['lineage'], ['rsi_lineages.name'],
                            name=op.f('fk_rsi_specialists_lineage_rsi_lineages'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_rsi_specialists'))
    )
    op.create_index(op.f('ix_rsi_specialists_lineage'), 'rsi_specialists', ['lineage'], unique=False)
    op.create_table('rsi_api_keys',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_rsi_api_keys')),
    sa.UniqueConstraint('key_hash', name=op.f('uq_rsi_api_keys_key_hash'))
    )
    op.create_table('rsi_conversations',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('api_key', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_conversations'))
    )
    op.create_index(op.f('ix_rsi_conversations_api_key'), 'rsi_conversations', ['api_key'], unique=False)
    op.create_table('rsi_conversation_messages',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('conversation_id', sa.String(length=64), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('message', sa.JSON(), nullable=False),
    sa.Column('specialist', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['conversation_id'], ['rsi_conversations.id'],
                            name=op.f('fk_rsi_conversation_messages_conversation_id_rsi_conversations'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_conversation_messages')),
    sa.UniqueConstraint('conversation_id', 'position', name=op.f('uq_rsi_conversation_messages_conversation_id'))
    )
    op.create_index(op.f('ix_rsi_conversation_messages_conversation_id'), 'rsi_conversation_messages',
                    ['conversation_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_rsi_conversation_messages_conversation_id'), table_name='rsi_conversation_messages')
    op.drop_table('rsi_conversation_messages')
    op.drop_index(op.f('ix_rsi_conversations_api_key'), table_name='rsi_conversations')
    op.drop_table('rsi_conversations')
    op.drop_table('rsi_api_keys')
    op.drop_index(op.f('ix_rsi_specialists_lineage'), table_name='rsi_specialists')
    op.drop_table('rsi_specialists')
