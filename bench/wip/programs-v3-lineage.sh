#!/bin/bash
# One programs lineage under programs/v3 (worked runs verified state by state), LoRA rank 128 (every projection's full
# rank on the 128-wide base: bench/wip/programs_rank.py), 4,096 tasks a level (1,024 lookahead), held-out gate 256 a
# level; the base learns v2's text (the same as v3's) with context 1,024.
#   bench/wip/programs-v3-lineage.sh PROPOSER LINEAGE GENERATIONS [--set KEY=VALUE ...]
# The session note of 2026-12-07's runs, RSI_HOME=/tmp/e27/home3 (one base, built by the first):
#   v3l3:  generator v3l3 1 --set 'base_recipe.train_levels=[1,2,3]' --set 'base_recipe.level_weights=[1.0,2.0,0.25]'
#   v3lr:  the same, lineage v3lr, --set train.lr=3e-4
#   v3rep: the same as v3lr, lineage v3rep, --set replay_tasks_per_level=512 (each run stopped after generation 1)
#   v3lr4: the same as v3l3, lineage v3lr4, --set train.lr=1e-4 (promoted; run again: its generation 2)
#   v3ff:  the same as v3lr4, lineage v3ff, --set train.frontier_fraction=0.25
cd "$(dirname "$0")/../.."
proposer=$1 lineage=$2 generations=$3; shift 3
/usr/bin/time -f "%U user %S sys %e wall" .venv/bin/rsi run programs --proposer "$proposer" --lineage "$lineage" \
  --generations "$generations" --harness harness_versions/programs/v3 \
  --set base_recipe.harness=programs/v2 --set base_recipe.max_position_embeddings=1024 \
  --set train.lora_r=128 --set train.lora_alpha=256 --set eval_n=256 \
  --set curriculum.tasks_per_level=4096 --set curriculum.lookahead_tasks=1024 "$@"
