"""The agents' models: loading a base, the agents' policies (LoRA adapters or full copies), prompts, attention and memory-lean scoring."""
