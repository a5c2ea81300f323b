"""Training over several processes: data parallel (data_parallel.py) and FSDP for a base that does not fit one GPU (fsdp.py)."""
