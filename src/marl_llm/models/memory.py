"""Memory arithmetic of a model and of the device it runs on: the KV cache's bytes, and how many
of them a rollout may take.

    kv_cache_bytes(config, torch.bfloat16, tokens)    # K and V of `tokens` positions, every layer
    kv_budget(device, "auto")                         # (bytes, how it was chosen)

A cached position holds a key and a value vector per K/V head in every layer:

    bytes per position per layer = 2 * num_key_value_heads * head_dim * itemsize(dtype)

(Qwen2.5-1.5B in bf16: 2 * 2 * 128 * 2 = 1 KiB per layer, 28 KiB over its 28 layers; Qwen3-8B:
4 KiB per layer, 144 KiB over 36.) Read from a Hugging Face config (its text config for a
multimodal one). Every layer is counted as full attention: for a model with sliding-window layers
this is an upper bound.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# The share of the free memory a rollout's KV cache may take by default (trainer.kv_cache_gib=auto).
# The rest is the decode's other tensors (a [rows, vocab] fp32 logits buffer and the sampler's
# int64 CDF: ~0.2 GiB at 64 rows of Qwen's 152k vocabulary; the prefill's activations).
CUDA_FREE_SHARE = 0.8
# On the CPU the cache lives in RAM that the rest of the run (and other processes) share.
CPU_AVAILABLE_SHARE = 0.5


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def _text_config(config: Any) -> Any:
    if hasattr(config, "get_text_config"):
        return config.get_text_config()
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


def _itemsize(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token_per_layer(config: Any, dtype: torch.dtype | str) -> int:
    """Bytes one cached position takes in one layer: its key and value over every K/V head.
    `config`: a transformers config (or its config.json as a dict); `dtype`: the cache's dtype
    (the compute dtype: bf16 under autocast)."""
    cfg = _text_config(config)
    heads = _get(cfg, "num_attention_heads")
    kv_heads = _get(cfg, "num_key_value_heads") or heads
    head_dim = _get(cfg, "head_dim") or _get(cfg, "hidden_size") // heads
    return 2 * kv_heads * head_dim * _itemsize(dtype)


def kv_cache_bytes(config: Any, dtype: torch.dtype | str, tokens: int) -> int:
    """Bytes of a KV cache holding `tokens` positions (summed over rows) in every layer."""
    return tokens * _get(_text_config(config), "num_hidden_layers") * kv_bytes_per_token_per_layer(config, dtype)


def available_ram_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget(device: torch.device | str, setting: Any = "auto", held: int = 0) -> tuple[int, str]:
    """(bytes a rollout's KV cache may take, how that was chosen). `setting`: a number of GiB
    (trainer.kv_cache_gib), or "auto": on CUDA CUDA_FREE_SHARE of the memory free now (the
    driver's free memory plus what torch's allocator holds unused) plus `held` (caches the
    rollout keeps between calls, which it reuses); elsewhere CPU_AVAILABLE_SHARE of the RAM
    available now."""
    if setting != "auto":
        return int(float(setting) * 2**30), f"trainer.kv_cache_gib={setting}"
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) + held
        return int(CUDA_FREE_SHARE * free), f"{CUDA_FREE_SHARE:.0%} of the {free / 2**30:.1f} GiB free on {device}"
    free = available_ram_bytes() + held
    return int(CPU_AVAILABLE_SHARE * free), f"{CPU_AVAILABLE_SHARE:.0%} of the {free / 2**30:.1f} GiB of RAM available"
