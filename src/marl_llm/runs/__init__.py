"""Run I/O: run dirs, checkpoints, metric loggers, exported agents, atomic writes."""
