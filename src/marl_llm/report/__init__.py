"""`marl-llm-report`: tables, statistics and plots over finished runs."""
