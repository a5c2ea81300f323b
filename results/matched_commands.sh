#!/usr/bin/env bash
# The matched-budget comparisons in results/matched/<task>.md: MAGRPO, CoLLM-CC and CoLLM-DC with the
# same number of joint actions per run (conf/experiment/matched_<task>_*.yaml: StrBuild 60, TLDR 32),
# 2 seeds each, on the embedded SmolLM2-135M-Instruct, 2 CPU cores, two runs side by side (one core
# each). The untrained team is evaluated once (greedy, so one seed says it all): max_steps=0.
#   results/matched_commands.sh strbuild && results/matched_commands.sh tldr
set -euo pipefail
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
TASK=${1:?usage: $0 strbuild|tldr} OUT=${OUT:-outputs/${1}_matched}
run() {  # run <method> <seed> [overrides...]
  local method=$1 seed=$2; shift 2
  marl-llm seed=$seed hydra.run.dir=$OUT/$method/seed$seed "$@" > $OUT.$method.$seed.log 2>&1
}
export -f run; export TASK OUT
{ echo "untrained 0 experiment=matched_${TASK}_magrpo trainer.max_steps=0 logger.group=untrained"
  for seed in 0 1; do for algo in magrpo collm_cc collm_dc; do echo "$algo $seed experiment=matched_${TASK}_$algo"; done; done
} | xargs -P 2 -L 1 bash -c 'run "$@"' _
marl-llm-report "$OUT" --out results/matched --commands results/matched_commands.sh
