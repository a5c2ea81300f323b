"""`marl-llm-report`: tables, statistics and plots over finished runs.

Modules, each importing only modules listed after it: cli (`main`, `write_report`), tables (md/csv/json),
plots, aggregate (the numbers per task and group), grouping (rows and the mixed-settings checks), stats
(std, IQM, bootstrap intervals), runs (finding and loading run directories).
"""
