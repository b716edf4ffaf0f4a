#!/bin/bash
# one generation of the programs lineage, generator proposer, under v1 and under v2 (the bases of expA), 1 thread each
cd "$(dirname "$0")/../.."  # the repository; run after applying bench/wip/issue27-proposer.patch (continues the lineages of programs-generation-v1-v2.sh)
export OMP_NUM_THREADS=1 PATH=$PWD/.venv/bin:$PATH
for v in v1 v2; do
  (
  export RSI_HOME=/tmp/exp/$v PREFECT_HOME=/tmp/exp/$v/prefect
  extra="--set curriculum.tasks_per_level=128 --set curriculum.lookahead_tasks=64"
  [ $v = v2 ] && extra="$extra --set base_recipe.harness=programs/v2 --set base_recipe.max_position_embeddings=768 --set harness=harness_versions/programs/v2"
  /usr/bin/time -f "%U user %S sys %e wall" timeout 1080 rsi run programs --proposer generator --generations 3 --lineage gen-$v $extra > /tmp/exp/$v.run3.log 2>&1
  ) &
done
wait
