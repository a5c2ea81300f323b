"""The console scripts: `marl-llm` (train.py) and `marl-llm-eval` (eval.py)."""
