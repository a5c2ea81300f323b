"""`make bench`: marl-llm against its peers' own packages on one workload, side by side.

Each system runs in its own worker process (`marl_llm.bench.worker`), so peak memory is each
system's own; the driver (`python -m marl_llm.bench`) alternates their steps A B A B.
"""
