"""An optional vLLM rollout backend for GPU runs: `trainer.rollout=vllm`.

Same interface as `HFRollout` (`generate(requests)`, `update_weights()`), plus `release()` and
`close()`. vLLM serves the frozen base with multi-LoRA, one LoRA slot per agent adapter. After
every update the trainer calls `update_weights()`, which exports each adapter (peft format,
atomically) and gives it a new LoRA id, so vLLM loads the new weights instead of its cached copy.
Prompts go in as token ids (the same chat-template ids HFRollout uses) and completions come back
as ids, cut at the first end of sequence exactly as HFRollout cuts them, so training log-probs
score what was sampled.

LoRA rank: vLLM accepts only some `max_lora_rank` values (1, 8, 16, 32, 64, 128, 256, 320, 512 in
vllm/config/lora.py; the installed vLLM's own list is read when it has one): the served adapters'
largest rank is rounded up to the next allowed one (`max_lora_rank`).

GPU memory (`trainer.vllm_sleep`, on by default): vLLM runs with `enable_sleep_mode`. The first
`generate` of a rollout phase wakes it (after `torch.cuda.empty_cache()` hands the trainer's cached
blocks back); `release()`, which `train_step` calls between the rollout and the update, puts it to
sleep at level 1: the KV cache is dropped and the base weights wait in CPU memory, so the update
has the GPU. Level 2 would drop the base weights too and need them reloaded on every wake (and
crashes with LoRA in some vLLM versions); the base never changes here, only the adapters (by file).
One sleep/wake cycle per trainer step, not per `generate` call: a multi-turn rollout calls
`generate` once per turn, and each cycle copies the base weights both ways (seconds for an 8B base).

Exported adapters live under `root` (the trainer passes <run_dir>/vllm_adapters/rank<r>): a shared
node's /tmp is often small, RAM-backed or shared between jobs, and a run killed before it cleans up
(SLURM timeout) leaves them where the run's own files are and where its requeued attempt clears
them. `close()` (the trainer calls it when the run ends) removes them; a `weakref.finalize` does
so too if the rollout is dropped without `close()`. Without `root`: a fresh temp dir ($TMPDIR).

Sampler/trainer mismatch: vLLM samples with its own kernels, dtype and batching, so its tokens
come from (almost) the trainer's policy, not exactly, and the default MAGRPO loss has no ratio to
absorb the difference. Each completion therefore carries the sampled tokens' log-probs
(`Completion.rollout_logprobs`: `SamplingParams(logprobs=0)` returns the sampled token's; with
`logprobs_mode="raw_logprobs"` they are of the raw model distribution, before temperature, top-k/p
and penalties: the trainer's own definition, `rollout.completion_logprobs`), and the update
weights every token's loss by the truncated importance ratio min(exp(logp_trainer - logp_vllm), C)
(`algo.rollout_is_cap`; algos/losses.py). An end-of-sequence token vLLM stopped on without
returning it is appended (it is scored, as HFRollout's are) with a NaN log-prob: weight 1.

Several processes (data-parallel ranks): each rank runs its own engine on its own GPU through
vLLM's external-launcher executor (`distributed_executor_backend="external_launcher"`, as TRL's
colocated mode and verl run it): the engine joins the launcher's process group from RANK /
LOCAL_RANK / WORLD_SIZE, on the device the rank set, instead of starting workers of its own on
GPU 0. It needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (set here), a seed per rank, and LOCAL_RANK set to
the index of the rank's GPU among those it sees (0 where each task sees one GPU, SLURM's
--gpus-per-task), which the executor takes as its device. A vLLM without
that executor is refused in one line (`engine_kwargs_for_world`).

This backend has not run against a real vLLM here (no GPU or vLLM in the development machine):
tests/test_vllm_rollout.py drives it with a stand-in `vllm` module.
"""

from __future__ import annotations

import inspect
import math
import os
import shutil
import tempfile
import typing
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch

from marl_llm.distributed import data_parallel as distributed
from marl_llm.config import UserError
from marl_llm.models.policies import AgentPolicies
from marl_llm.models.prompting import encode_prompt
from marl_llm.rollout.base import Completion, GenRequest
from marl_llm.rollout.decode import to_completion

INSTALL = ("trainer.rollout=vllm needs vLLM on a CUDA machine (pip install vllm); without it use "
           "trainer.rollout=hf (the default)")

# vLLM's allowed max_lora_rank values (vllm/config/lora.py `MaxLoRARanks`), for a vLLM that does
# not expose its own list.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Level 1 keeps the base weights in CPU memory (they never change here); level 2 would discard them.
SLEEP_LEVEL = 1


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def visible_gpus() -> int:
    """The GPUs this process sees (its CUDA_VISIBLE_DEVICES)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require_vllm() -> Any:
    """The vllm module, or a UserError that names the fix (no GPU, or vLLM not installed)."""
    try:
        import vllm
    except ImportError:
        raise UserError(INSTALL) from None
    if not _has_cuda():
        raise UserError("trainer.rollout=vllm needs a CUDA GPU; on this machine use trainer.rollout=hf")
    return vllm


def allowed_lora_ranks() -> tuple[int, ...]:
    """The installed vLLM's allowed max_lora_rank values, sorted (VLLM_LORA_RANKS if it has no list)."""
    for module in ("vllm.config.lora", "vllm.config"):
        try:
            ranks = typing.get_args(getattr(__import__(module, fromlist=["MaxLoRARanks"]), "MaxLoRARanks"))
        except (ImportError, AttributeError):
            continue
        if ranks and all(isinstance(r, int) for r in ranks):
            return tuple(sorted(ranks))
    return VLLM_LORA_RANKS


def max_lora_rank(ranks: Iterable[int], allowed: Iterable[int] = VLLM_LORA_RANKS) -> int:
    """The smallest allowed vLLM max_lora_rank that holds every adapter rank in `ranks`."""
    top, allowed = max(ranks), sorted(allowed)
    fits = [r for r in allowed if r >= top]
    if not fits:
        raise UserError(f"LoRA rank {top} is above vLLM's largest max_lora_rank {allowed[-1]}: set "
                        f"algo.lora.r<={allowed[-1]} or use trainer.rollout=hf")
    return fits[0]


def adapter_rank(model, adapter: str) -> int:
    """The largest rank of one peft adapter (its `r`, or a larger per-module `rank_pattern` entry)."""
    cfg = model.peft_config[adapter]
    return max([cfg.r, *(getattr(cfg, "rank_pattern", None) or {}).values()])


def engine_accepts(vllm: Any, name: str) -> bool:
    """Whether vLLM's engine arguments (what `LLM(**kwargs)` forwards) have `name`."""
    try:
        return name in inspect.signature(vllm.EngineArgs).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def engine_kwargs_for_world(vllm: Any, seed: int) -> dict[str, Any]:
    """The engine arguments that place this rank's engine (and its seed) when the run has several
    processes (module docstring); {} for one process. Sets the environment the external launcher
    reads. A vLLM without the external-launcher executor: UserError naming the fix."""
    w = distributed.world()
    if w.size == 1:
        return {"seed": seed}
    if not engine_accepts(vllm, "distributed_executor_backend"):
        raise UserError(f"trainer.rollout=vllm with {w.size} processes needs vLLM's external-launcher executor "
                        "(distributed_executor_backend), which this vLLM lacks: upgrade vLLM, run one process, or "
                        "use trainer.rollout=hf")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the executor's precondition: the engine in this process
    for name, value in (("RANK", w.rank), ("WORLD_SIZE", w.size)):
        os.environ.setdefault(name, str(value))
    # The executor puts the engine on cuda:<LOCAL_RANK>. Where a task sees only its own GPU (SLURM's
    # --gpus-per-task, CUDA_VISIBLE_DEVICES per task) that index does not exist for local rank > 0:
    # it must be the GPU this rank computes on (distributed.cuda_index), not its rank on the node.
    os.environ["LOCAL_RANK"] = str(distributed.cuda_index(w.local_rank, visible_gpus()))
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1, "seed": seed + w.rank}


def sampled_logprobs(sample: Any) -> list[float]:
    """The log-prob of each sampled token of one vLLM `CompletionOutput` (`SamplingParams(logprobs=0)`:
    per position a {token id: Logprob} holding at least the sampled token's); NaN where missing."""
    steps = sample.logprobs or [None] * len(sample.token_ids)
    return [float(step[t].logprob) if step is not None and t in step else math.nan
            for step, t in zip(steps, sample.token_ids)]


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


def _remove_exports(directory: Path, root: Path | None) -> None:
    """Remove the exported adapters, and `root` once no rank's exports are left in it."""
    shutil.rmtree(directory, ignore_errors=True)
    if root is not None:
        try:
            root.rmdir()
        except OSError:  # another rank's exports are still there (or it is gone already)
            pass


class VLLMRollout:
    """Generation with vLLM, one LoRA slot per agent adapter; adapters synced after each update."""

    def __init__(self, policies: AgentPolicies, gpu_memory_utilization: float = 0.4, sleep: bool = True,
                 root: Path | None = None):
        if policies.full:
            raise UserError("trainer.rollout=vllm serves LoRA adapters on one base, but algo.lora=null fully "
                            "fine-tunes every policy: use trainer.rollout=hf")
        vllm = require_vllm()
        if len(policies.models) > 1:
            raise UserError("trainer.rollout=vllm serves one base model: unset model.agent_bases or use trainer.rollout=hf")
        self.policies = policies
        self.vllm = vllm
        model = policies.models[0]
        base = model.get_base_model()
        # Only the agents' adapters are served (critic adapters are added later and stay with the trainer).
        self.adapters = [name for _, name in policies.trainable_adapters()]
        rank = max_lora_rank((adapter_rank(model, a) for a in self.adapters), allowed_lora_ranks())
        if root is None:
            self.dir = Path(tempfile.mkdtemp(prefix="marl-llm-vllm-"))
        else:
            root = Path(root)
            self.dir = root / f"rank{distributed.world().rank}"
            shutil.rmtree(self.dir, ignore_errors=True)  # a killed attempt's exports (requeued job)
            self.dir.mkdir(parents=True)
        self._cleanup = weakref.finalize(self, _remove_exports, self.dir, root)
        kwargs: dict[str, Any] = dict(
            model=base.name_or_path, tokenizer=base.name_or_path, enable_lora=True, max_loras=len(self.adapters),
            max_lora_rank=rank, dtype={torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(policies.dtype, "float32"),
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=True,  # siblings share their prompt's KV blocks
            enable_sleep_mode=sleep, **engine_kwargs_for_world(vllm, policies.seed))
        if engine_accepts(vllm, "logprobs_mode"):
            # The sampled tokens' log-probs under the raw model (what the trainer computes), not
            # after temperature / top-k / top-p. (Older V1 engines return raw ones by default.)
            kwargs["logprobs_mode"] = "raw_logprobs"
        self.llm = vllm.LLM(**kwargs)
        self.sleep, self.asleep = sleep, False
        self.version = 0
        self.lora_requests: dict[str, Any] = {}
        self.update_weights()
        self.release()  # the trainer's first phase may not be a rollout

    def _check_open(self) -> None:
        if self.llm is None:
            raise RuntimeError("this VLLMRollout is closed")

    def update_weights(self) -> None:
        """Export every agent adapter and register it under a fresh LoRA id (vLLM caches by id)."""
        from vllm.lora.request import LoRARequest

        self._check_open()
        self.version += 1
        model = self.policies.models[0]
        for slot, name in enumerate(self.adapters):
            path = export_adapter(model, name, self.dir / f"{name}-v{self.version}")
            lora_id = self.version * len(self.adapters) + slot + 1
            self.lora_requests[name] = LoRARequest(f"{name}-v{self.version}", lora_id, str(path))
            old = self.dir / f"{name}-v{self.version - 1}"
            if old.exists():  # vLLM loaded it for the last rollout; no request names it again
                shutil.rmtree(old, ignore_errors=True)

    def wake(self) -> None:
        """Give vLLM its GPU memory back (no-op when awake or without sleep mode)."""
        if self.sleep and self.asleep:
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()  # the trainer's cached blocks back to the driver, for vLLM
            self.llm.wake_up()
            self.asleep = False

    def release(self) -> None:
        """Put vLLM to sleep (level 1) so the update has the GPU; the next `generate` wakes it."""
        if self.sleep and not self.asleep and self.llm is not None:
            self.llm.sleep(level=SLEEP_LEVEL)
            self.asleep = True

    def close(self) -> None:
        """Remove the exported adapters and drop the engine (its GPU memory goes with its last
        reference). Idempotent; the rollout cannot generate afterwards."""
        self._cleanup()
        self.llm = None

    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        self._check_open()
        if not requests:
            return []
        self.wake()
        tok, eos_ids = self.policies.tokenizers[0], self.policies.eos_ids[0]
        prompts = [encode_prompt(tok, r.message) for r in requests]
        params = [self.vllm.SamplingParams(
            temperature=r.sampling.temperature, top_p=r.sampling.top_p, top_k=r.sampling.top_k if r.sampling.top_k else -1,
            max_tokens=r.sampling.max_new_tokens, min_tokens=r.sampling.min_new_tokens, stop_token_ids=eos_ids,
            skip_special_tokens=True, seed=r.key, logprobs=0) for r in requests]
        loras = [self.lora_requests[self.policies.agents[r.agent].adapter] for r in requests]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params,
                                    lora_request=loras, use_tqdm=False)
        results = []
        for prompt, out, request in zip(prompts, outputs, requests):
            sample = out.outputs[0]
            ids, logps = list(sample.token_ids), sampled_logprobs(sample)
            if sample.finish_reason == "stop" and (not ids or ids[-1] not in eos_ids):
                # The completion ends with its end-of-sequence token, as HFRollout's do (it is
                # scored); vLLM reported no log-prob for it: NaN, weight 1.
                ids.append(sample.stop_reason if isinstance(sample.stop_reason, int) else eos_ids[0])
                logps.append(math.nan)
            # A stop rule (algo.sampling.stop) cuts the completion here: vLLM knows only stop strings.
            completion = to_completion(tok, prompt, torch.tensor(ids, dtype=torch.long), eos_ids, request.sampling.stop)
            completion.rollout_logprobs = torch.tensor(logps[:len(completion.completion_ids)], dtype=torch.float32)
            results.append(completion)
        return results
