"""Generation: the decode loop (decode.py), mixed-adapter LoRA for mixed batches (mixed_lora.py) and the vLLM backend (vllm.py)."""
