#!/usr/bin/env bash
# The matched-budget TLDR comparison in results/tldr_matched/tldr.md: MAGRPO, CoLLM-CC and CoLLM-DC with
# the same number of joint actions (32 per run: conf/experiment/matched_tldr_*.yaml), 2 seeds
# each, on the embedded SmolLM2-135M-Instruct, 2 CPU cores, two runs side by side (one core each).
set -euo pipefail
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
OUT=${OUT:-outputs/tldr_matched}
for seed in 0 1; do for algo in magrpo collm_cc collm_dc; do echo "$algo $seed"; done; done |
  xargs -P 2 -L 1 bash -c 'marl-llm experiment=matched_tldr_$0 seed=$1 hydra.run.dir='"$OUT"'/$0/seed$1 > '"$OUT"'.$0.$1.log 2>&1'
marl-llm-report "$OUT" --out results/tldr_matched --commands results/tldr_matched_commands.sh
