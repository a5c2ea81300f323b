"""An optional vLLM rollout backend for GPU runs: `trainer.rollout=vllm`.

Same interface as `HFRollout` (`generate(requests)`, `update_weights()`): vLLM serves the frozen
base with multi-LoRA, one LoRA slot per agent adapter. After every update the trainer calls
`update_weights()`, which exports each adapter (peft format, atomically) and gives it a new LoRA
id, so vLLM loads the new weights instead of its cached copy. Prompts go in as token ids (the
same chat-template ids HFRollout uses) and completions come back as ids, cut at the first end of
sequence exactly as HFRollout cuts them, so training log-probs score what was sampled.

vLLM samples in its own kernels and dtype: its tokens come from (almost) the trainer's policy,
not exactly; PPO-style clipping (`algo.clip_eps`) absorbs the small mismatch.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from marl_llm.config import UserError
from marl_llm.models import AgentPolicies
from marl_llm.prompting import encode_prompt
from marl_llm.rollout import Completion, GenRequest, to_completion

INSTALL = ("trainer.rollout=vllm needs vLLM on a CUDA machine (pip install vllm); without it use "
           "trainer.rollout=hf (the default)")


def require_vllm() -> Any:
    """The vllm module, or a UserError that names the fix (no GPU, or vLLM not installed)."""
    try:
        import vllm
    except ImportError:
        raise UserError(INSTALL) from None
    if not torch.cuda.is_available():
        raise UserError("trainer.rollout=vllm needs a CUDA GPU; on this machine use trainer.rollout=hf")
    return vllm


def export_adapter(model, adapter: str, target: Path) -> Path:
    """Write one adapter of a peft model in peft's own format (adapter_config.json and
    adapter_model.safetensors) to `target`, atomically (a temp sibling renamed into place)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, selected_adapters=[adapter])
        # peft writes non-default adapters into a subfolder named after them.
        src = tmp / adapter if (tmp / adapter / "adapter_config.json").exists() else tmp
        if target.exists():
            shutil.rmtree(target)
        src.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class VLLMRollout:
    """Generation with vLLM, one LoRA slot per agent adapter; adapters synced after each update."""

    def __init__(self, policies: AgentPolicies, gpu_memory_utilization: float = 0.4):
        if policies.full:
            raise UserError("trainer.rollout=vllm serves LoRA adapters on one base, but algo.lora=null fully "
                            "fine-tunes every policy: use trainer.rollout=hf")
        vllm = require_vllm()
        if len(policies.models) > 1:
            raise UserError("trainer.rollout=vllm serves one base model: unset model.agent_bases or use trainer.rollout=hf")
        self.policies = policies
        self.vllm = vllm
        base = policies.models[0].get_base_model()
        self.adapters = [name for _, name in policies.trainable_adapters()]
        self.dir = Path(tempfile.mkdtemp(prefix="marl-llm-vllm-"))
        self.llm = vllm.LLM(model=base.name_or_path, tokenizer=base.name_or_path, enable_lora=True,
                            max_loras=len(self.adapters), max_lora_rank=max(16, policies.lora.r),
                            dtype={torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(policies.dtype, "float32"),
                            gpu_memory_utilization=gpu_memory_utilization, seed=policies.seed,
                            enable_prefix_caching=True)  # siblings share their prompt's KV blocks
        self.version = 0
        self.lora_requests: dict[str, Any] = {}
        self.update_weights()

    def update_weights(self) -> None:
        """Export every agent adapter and register it under a fresh LoRA id (vLLM caches by id)."""
        from vllm.lora.request import LoRARequest

        self.version += 1
        model = self.policies.models[0]
        for slot, name in enumerate(self.adapters):
            path = export_adapter(model, name, self.dir / f"{name}-v{self.version}")
            lora_id = self.version * len(self.adapters) + slot + 1
            self.lora_requests[name] = LoRARequest(f"{name}-v{self.version}", lora_id, str(path))
            old = self.dir / f"{name}-v{self.version - 1}"
            if old.exists():
                shutil.rmtree(old, ignore_errors=True)

    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        tok, eos_ids = self.policies.tokenizers[0], self.policies.eos_ids[0]
        prompts = [encode_prompt(tok, r.message) for r in requests]
        params = [self.vllm.SamplingParams(
            temperature=r.sampling.temperature, top_p=r.sampling.top_p, top_k=r.sampling.top_k if r.sampling.top_k > 0 else -1,
            max_tokens=r.sampling.max_new_tokens, min_tokens=r.sampling.min_new_tokens, stop_token_ids=eos_ids,
            skip_special_tokens=True, seed=r.key) for r in requests]
        loras = [self.lora_requests[self.policies.agents[r.agent].adapter] for r in requests]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params,
                                    lora_request=loras, use_tqdm=False)
        results = []
        for prompt, out in zip(prompts, outputs):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            if sample.finish_reason == "stop" and (not ids or ids[-1] not in eos_ids):
                # The completion ends with its end-of-sequence token, as HFRollout's do (it is scored).
                ids.append(sample.stop_reason if isinstance(sample.stop_reason, int) else eos_ids[0])
            results.append(to_completion(tok, prompt, torch.tensor(ids, dtype=torch.long), eos_ids))
        return results
