"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-12-02 16:51:55.043051
"""

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('rsi_leases',
    sa.Column('lineage', sa.String(length=64), nullable=False),
    sa.Column('holder', sa.String(length=128), nullable=False),
    sa.Column('acquired_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ttl_s', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('lineage', name=op.f('pk_rsi_leases'))
    )
    op.create_table('rsi_lineages',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('family', sa.String(length=64), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_rsi_lineages'))
    )
    op.create_table('rsi_tasks',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('family', sa.String(length=64), nullable=False),
    sa.Column('family_version', sa.String(length=16), nullable=False),
    sa.Column('level', sa.Integer(), nullable=False),
    sa.Column('seed', sa.BigInteger(), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('split', sa.String(length=16), nullable=False),
    sa.Column('payload', sa.JSON(), nullable=False),
    sa.Column('answer', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_tasks'))
    )
    with op.batch_alter_table('rsi_tasks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rsi_tasks_family'), ['family'], unique=False)
        batch_op.create_index(batch_op.f('ix_rsi_tasks_level'), ['level'], unique=False)

    op.create_table('rsi_generations',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('lineage', sa.String(length=64), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('parent_pair_id', sa.String(length=64), nullable=True),
    sa.Column('candidate_pair_id', sa.String(length=64), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('stages', sa.JSON(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['lineage'], ['rsi_lineages.name'], name=op.f('fk_rsi_generations_lineage_rsi_lineages'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_generations')),
    sa.UniqueConstraint('lineage', 'number', name=op.f('uq_rsi_generations_lineage'))
    )
    with op.batch_alter_table('rsi_generations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rsi_generations_lineage'), ['lineage'], unique=False)

    op.create_table('rsi_pairs',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('lineage', sa.String(length=64), nullable=True),
    sa.Column('base_model_hash', sa.String(length=64), nullable=False),
    sa.Column('adapter_hash', sa.String(length=64), nullable=True),
    sa.Column('adapter_uri', sa.Text(), nullable=True),
    sa.Column('harness_id', sa.String(length=128), nullable=False),
    sa.Column('harness_hash', sa.String(length=64), nullable=False),
    sa.Column('parent_pair_id', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['lineage'], ['rsi_lineages.name'], name=op.f('fk_rsi_pairs_lineage_rsi_lineages'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_pairs'))
    )
    with op.batch_alter_table('rsi_pairs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rsi_pairs_lineage'), ['lineage'], unique=False)

    op.create_table('rsi_datasets',
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('lineage', sa.String(length=64), nullable=True),
    sa.Column('generation_id', sa.Integer(), nullable=True),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('filters', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['generation_id'], ['rsi_generations.id'], name=op.f('fk_rsi_datasets_generation_id_rsi_generations'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['lineage'], ['rsi_lineages.name'], name=op.f('fk_rsi_datasets_lineage_rsi_lineages'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('digest', name=op.f('pk_rsi_datasets'))
    )
    with op.batch_alter_table('rsi_datasets', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rsi_datasets_lineage'), ['lineage'], unique=False)

    op.create_table('rsi_evaluations',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('pair_id', sa.String(length=64), nullable=False),
    sa.Column('generation_id', sa.Integer(), nullable=True),
    sa.Column('level', sa.Integer(), nullable=False),
    sa.Column('split', sa.String(length=16), nullable=False),
    sa.Column('seed', sa.BigInteger(), nullable=False),
    sa.Column('n', sa.Integer(), nullable=False),
    sa.Column('correct', sa.Integer(), nullable=False),
    sa.Column('accuracy', sa.Float(), nullable=False),
    sa.Column('ci_low', sa.Float(), nullable=False),
    sa.Column('ci_high', sa.Float(), nullable=False),
    sa.Column('decoding', sa.String(length=32), nullable=False),
    sa.Column('outcomes', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['generation_id'], ['rsi_generations.id'], name=op.f('fk_rsi_evaluations_generation_id_rsi_generations'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['pair_id'], ['rsi_pairs.id'], name=op.f('fk_rsi_evaluations_pair_id_rsi_pairs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_evaluations')),
    sa.UniqueConstraint('pair_id', 'level', 'split', 'seed', 'n', 'decoding', name=op.f('uq_rsi_evaluations_pair_id'))
    )
    with op.batch_alter_table('rsi_evaluations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rsi_evaluations_pair_id'), ['pair_id'], unique=False)

    op.create_table('rsi_stage_runs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('generation_id', sa.Integer(), nullable=False),
    sa.Column('stage', sa.String(length=32), nullable=False),
    sa.Column('inputs_hash', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['generation_id'], ['rsi_generations.id'], name=op.f('fk_rsi_stage_runs_generation_id_rsi_generations'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_stage_runs')),
    sa.UniqueConstraint('generation_id', 'stage', 'inputs_hash', name=op.f('uq_rsi_stage_runs_generation_id'))
    )
    with op.batch_alter_table('rsi_stage_runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rsi_stage_runs_generation_id'), ['generation_id'], unique=False)

    op.create_table('rsi_trajectories',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('task_id', sa.String(length=64), nullable=False),
    sa.Column('pair_id', sa.String(length=64), nullable=False),
    sa.Column('generation_id', sa.Integer(), nullable=True),
    sa.Column('harness_id', sa.String(length=128), nullable=False),
    sa.Column('sample_index', sa.Integer(), nullable=False),
    sa.Column('seed', sa.BigInteger(), nullable=False),
    sa.Column('messages', sa.JSON(), nullable=False),
    sa.Column('finish_reason', sa.String(length=16), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('timings', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['generation_id'], ['rsi_generations.id'], name=op.f('fk_rsi_trajectories_generation_id_rsi_generations'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['task_id'], ['rsi_tasks.id'], name=op.f('fk_rsi_trajectories_task_id_rsi_tasks')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_trajectories'))
    )
    with op.batch_alter_table('rsi_trajectories', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rsi_trajectories_generation_id'), ['generation_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_rsi_trajectories_pair_id'), ['pair_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_rsi_trajectories_task_id'), ['task_id'], unique=False)

    op.create_table('rsi_dataset_items',
    sa.Column('dataset_digest', sa.String(length=64), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('trajectory_id', sa.String(length=64), nullable=False),
    sa.ForeignKeyConstraint(['dataset_digest'], ['rsi_datasets.digest'], name=op.f('fk_rsi_dataset_items_dataset_digest_rsi_datasets'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['trajectory_id'], ['rsi_trajectories.id'], name=op.f('fk_rsi_dataset_items_trajectory_id_rsi_trajectories')),
    sa.PrimaryKeyConstraint('dataset_digest', 'position', name=op.f('pk_rsi_dataset_items'))
    )
    with op.batch_alter_table('rsi_dataset_items', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rsi_dataset_items_trajectory_id'), ['trajectory_id'], unique=False)

    op.create_table('rsi_verdicts',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('trajectory_id', sa.String(length=64), nullable=False),
    sa.Column('contract_version', sa.String(length=32), nullable=False),
    sa.Column('harness_hash', sa.String(length=64), nullable=False),
    sa.Column('passed', sa.Boolean(), nullable=False),
    sa.Column('rules', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['trajectory_id'], ['rsi_trajectories.id'], name=op.f('fk_rsi_verdicts_trajectory_id_rsi_trajectories'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rsi_verdicts')),
    sa.UniqueConstraint('trajectory_id', 'contract_version', 'harness_hash', name=op.f('uq_rsi_verdicts_trajectory_id'))
    )
    with op.batch_alter_table('rsi_verdicts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_rsi_verdicts_passed'), ['passed'], unique=False)
        batch_op.create_index(batch_op.f('ix_rsi_verdicts_trajectory_id'), ['trajectory_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('rsi_verdicts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rsi_verdicts_trajectory_id'))
        batch_op.drop_index(batch_op.f('ix_rsi_verdicts_passed'))

    op.drop_table('rsi_verdicts')
    with op.batch_alter_table('rsi_dataset_items', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rsi_dataset_items_trajectory_id'))

    op.drop_table('rsi_dataset_items')
    with op.batch_alter_table('rsi_trajectories', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rsi_trajectories_task_id'))
        batch_op.drop_index(batch_op.f('ix_rsi_trajectories_pair_id'))
        batch_op.drop_index(batch_op.f('ix_rsi_trajectories_generation_id'))

    op.drop_table('rsi_trajectories')
    with op.batch_alter_table('rsi_stage_runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rsi_stage_runs_generation_id'))

    op.drop_table('rsi_stage_runs')
    with op.batch_alter_table('rsi_evaluations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rsi_evaluations_pair_id'))

    op.drop_table('rsi_evaluations')
    with op.batch_alter_table('rsi_datasets', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rsi_datasets_lineage'))

    op.drop_table('rsi_datasets')
    with op.batch_alter_table('rsi_pairs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rsi_pairs_lineage'))

    op.drop_table('rsi_pairs')
    with op.batch_alter_table('rsi_generations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rsi_generations_lineage'))

    op.drop_table('rsi_generations')
    with op.batch_alter_table('rsi_tasks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_rsi_tasks_level'))
        batch_op.drop_index(batch_op.f('ix_rsi_tasks_family'))

    op.drop_table('rsi_tasks')
    op.drop_table('rsi_lineages')
    op.drop_table('rsi_leases')
