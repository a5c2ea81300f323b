"""Run I/O: run dirs, checkpoints, metric loggers, exported agents, atomic writes."""

# The one line of a Ctrl-C before a run claims its dir. Here, not in rundir.py, so that the console
# script's first signal handler (cli/launch.py) has it without importing anything heavy.
NOT_STARTED = "interrupted before the run started: nothing was trained; run the same command to start it"
