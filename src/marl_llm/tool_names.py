"""Names that other tools use for marl-llm's settings (TRL's GRPOConfig and TrainingArguments,
MAGRPO's), for the "did you mean" of an unknown config key (config_keys.walk_key). Where a name means
something else here, the hint says what differs."""

from __future__ import annotations

from typing import Callable

# Names that TRL (GRPOConfig and its TrainingArguments) and MAGRPO use for what has another name
# here: {their name: (the key here, what to know)}. A hint is given only where that key exists for
# the chosen algorithm (AT-GRPO's group is algo.num_branches, MAGRPO's algo.num_generations).
OTHER_TOOLS_NAMES: dict[str, tuple[str, str]] = {
    "num_generations": ("algo.num_branches", "AT-GRPO's K candidates per agent and turn, what MAGRPO and TRL call "
                                             "num_generations"),
    "beta": ("algo.kl_coef", "TRL's KL coefficient"),
    "epsilon": ("algo.clip_eps", "TRL's clipping range"),
    "max_completion_length": ("algo.sampling.max_new_tokens", "TRL's completion length"),
    "temperature": ("algo.sampling.temperature", "sampling settings live under algo.sampling"),
    "top_p": ("algo.sampling.top_p", "sampling settings live under algo.sampling"),
    "top_k": ("algo.sampling.top_k", "sampling settings live under algo.sampling"),
    "max_new_tokens": ("algo.sampling.max_new_tokens", "sampling settings live under algo.sampling"),
    "num_iterations": ("algo.ppo_epochs", "TRL's passes over each batch"),
    "lr_scheduler_type": ("algo.lr_scheduler", "TRL's schedule name"),
    "lr": ("algo.learning_rate", "the learning rate"),
    "scale_rewards": ("algo.normalize_advantages", "TRL's division of advantages by the group std"),
    "per_device_train_batch_size": ("trainer.prompts_per_step", "not the same count: TRL counts completions, "
                                                                "here problems per step, each sampling a group"),
    "gradient_accumulation_steps": ("trainer.completions_per_micro_batch", "not the same knob: here the "
                                                                           "completions per forward/backward pass"),
    "num_train_epochs": ("trainer.max_steps", "runs are counted in steps here"),
    "save_steps": ("trainer.save_every", "TRL's checkpoint interval"),
    "eval_steps": ("trainer.eval_every", "TRL's evaluation interval"),
    "use_vllm": ("trainer.rollout", "trainer.rollout=vllm"),
    "output_dir": ("hydra.run.dir", "the run dir is Hydra's"),
    "report_to": ("logger", "logger=wandb or logger=none"),
    "bf16": ("model.dtype", "model.dtype=bfloat16"),
    "seed": ("seed", "a top-level key"),
    "learning_rate": ("algo.learning_rate", "under algo"),
    "loss_type": ("algo.loss_type", "the per-token surrogate; TRL's loss_type (grpo, dapo, ...) is the "
                                    "aggregation, algo.loss_aggregation here"),
}


def other_tools_name(part: str, exists: Callable[[str], bool]) -> str:
    """" Did you mean <key>? (<why>)" for a name TRL or MAGRPO use, where <key> `exists` for the
    chosen algorithm and task; "" otherwise."""
    known = OTHER_TOOLS_NAMES.get(part)
    if known is None or not exists(known[0]):
        return ""
    return f" Did you mean {known[0]}? ({known[1]})"
