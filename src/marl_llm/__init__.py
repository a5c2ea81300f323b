"""marl-llm: cooperative multi-LLM training with multi-agent reinforcement learning."""

__version__ = "0.1.0"
