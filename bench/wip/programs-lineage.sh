#!/bin/bash
# One programs lineage, generator proposer, on the base of programs-bases-v1-v2.sh (run that first), 1 thread.
#   bench/wip/programs-lineage.sh BASE HARNESS LINEAGE GENERATIONS [--set KEY=VALUE ...]
# BASE v1|v2: the base recipe's harness (and RSI_HOME /tmp/exp/BASE); HARNESS v1|v2: the harness the lineage runs
# under. The session note's runs: "v1 base, v2 harness" rows = `v1 v2 gen-v1 1 ...`, v2 rows = `v2 v2 gen-v2 1 ...`
# with --set curriculum.tasks_per_level=128 --set curriculum.lookahead_tasks=64 (lineages gen-*), without them
# (gen512-*), then `... gen-v1 3` / `... gen-v2 3` with the 128-task sets to continue until the plateau stop.
cd "$(dirname "$0")/../.."  # the repository (issue 27's programs proposer is on main since b0251c5)
base=$1 harness=$2 lineage=$3 generations=$4; shift 4
export OMP_NUM_THREADS=1 PATH=$PWD/.venv/bin:$PATH RSI_HOME=/tmp/exp/$base PREFECT_HOME=/tmp/exp/$base/prefect
recipe=()
[ "$base" = v2 ] && recipe=(--set base_recipe.harness=programs/v2 --set base_recipe.max_position_embeddings=768)
/usr/bin/time -f "%U user %S sys %e wall" rsi run programs --proposer generator --generations "$generations" \
  --lineage "$lineage" --harness "harness_versions/programs/$harness" "${recipe[@]}" "$@"
