#!/usr/bin/env bash
# The TLDR comparison in results/tldr.md: MAGRPO against the papers' baselines, 2 seeds each, on
# the embedded SmolLM2-135M-Instruct, 2 CPU cores, offline (the packaged TLDR sample: 32 train /
# 16 held-out posts). The two MAGRPO seeds ran side by side, one core (OMP_NUM_THREADS=1) each.
set -euo pipefail
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
COMMON="task=tldr logger=none algo.sampling.temperature=0.7 algo.sampling.top_p=0.9 algo.sampling.max_new_tokens=128 trainer.eval_max_problems=null"
for seed in 0 1; do
  # MAGRPO: 24 steps of G=4 joint actions on one post each (about 25 minutes per run on one core).
  marl-llm algo=magrpo $COMMON seed=$seed algo.num_turns=1 algo.learning_rate=3e-4 trainer.max_steps=24 \
    hydra.run.dir=outputs/tldr_compare/magrpo/seed$seed &
done
wait
for seed in 0 1; do
  (
    # Prompt-only baselines, greedy evaluation (deterministic: both seeds give the same numbers).
    # single, untrained here (trainer.max_steps=0), writes both summaries in one answer: it gets the
    # two agents' token budget together (2 x 128).
    marl-llm algo=single $COMMON seed=$seed trainer.max_steps=0 algo.sampling.max_new_tokens=256 \
      hydra.run.dir=outputs/tldr_compare/single/seed$seed
    for algo in parallel sequential discussion; do
      marl-llm algo=$algo $COMMON seed=$seed hydra.run.dir=outputs/tldr_compare/$algo/seed$seed
    done
  ) &
done
wait
marl-llm-report outputs/tldr_compare --out results --commands results/tldr_commands.sh
