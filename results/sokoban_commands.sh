#!/usr/bin/env bash
# The Sokoban table in results/sokoban.md: AT-GRPO (shared and per-role policies) against the
# untrained two-agent system, embedded SmolLM2-135M-Instruct, 2 CPU cores (the three runs side by
# side, one core each), 5x5 maps with one box, success rate on the 100 fixed validation levels.
# CPU-sized: 2 turns per episode (the paper: 4), 96 new tokens per action, 3 steps of 2 levels (a first
# 10-step attempt showed every group with zero reward variance, so no gradient: see results/sokoban.md).
set -euo pipefail
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
COMMON="algo=at_grpo task=sokoban task.size=5 task.num_boxes=1 task.max_turns=2 logger=none seed=0 \
  algo.sampling.max_new_tokens=96 algo.num_branches=4 algo.learning_rate=2e-4 trainer.eval_max_problems=null"
# The untrained two-agent system (tool + plan): evaluation only.
marl-llm $COMMON trainer.max_steps=0 logger.group=untrained hydra.run.dir=outputs/sokoban_compare/untrained &
# AT-GRPO, one policy shared by both roles / one policy per role.
for adapters in shared per_agent; do
  marl-llm $COMMON algo.adapters=$adapters trainer.max_steps=3 trainer.prompts_per_step=2 trainer.eval_before=false \
    logger.group=at_grpo_$adapters hydra.run.dir=outputs/sokoban_compare/at_grpo_$adapters &
done
wait
marl-llm-report outputs/sokoban_compare --out results --task sokoban --commands results/sokoban_commands.sh
