#!/bin/bash
# base under v1 vs v2 (worked answers): per-level test accuracy, greedy, levels 1-6
cd "$(dirname "$0")/../.."  # the repository (issue 27's programs proposer is on main since b0251c5)
export OMP_NUM_THREADS=1 PATH=$PWD/.venv/bin:$PATH
for v in v1 v2; do
  (
  export RSI_HOME=/tmp/exp/$v PREFECT_HOME=/tmp/exp/$v/prefect
  mkdir -p $RSI_HOME
  extra=""
  [ $v = v2 ] && extra="--set base_recipe.harness=programs/v2 --set base_recipe.max_position_embeddings=768 --set harness=harness_versions/programs/v2"
  /usr/bin/time -v rsi base build --profile programs $extra > /tmp/exp/$v.build.log 2>&1
  rsi eval --profile programs $extra --harness harness_versions/programs/$v --split test --levels 1-6 --n 64 > /tmp/exp/$v.eval.log 2>&1
  rsi eval --profile programs $extra --harness harness_versions/programs/$v --split test --levels 1-6 --n 32 --k 8 > /tmp/exp/$v.pass8.log 2>&1
  ) &
done
wait
