"""Turn-based grid environments (plain Python state machines, no model needed): Sokoban and
Plan-Path. Tasks in marl_llm.tasks wrap them for the agents (prompts, roles, rewards)."""
