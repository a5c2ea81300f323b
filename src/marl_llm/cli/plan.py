"""The `marl-llm-plan` console script: the memory plan of a config before launch, per GPU.

    marl-llm-plan experiment=at_grpo_sokoban_qwen3_8b_paper                 # the GPUs the preset states
    marl-llm-plan experiment=magrpo_humaneval_paper plan.gpus=8 plan.gpu_gib=79.6 trainer.fsdp=true
    marl-llm-plan algo=collm_cc task=tldr model=qwen3_1_7b plan.gpus=1 plan.gpu_gib=24

The overrides are marl-llm's (the same config, composed and checked the same way); `plan.gpus`
GPUs (default 1) of `plan.gpu_gib` GiB (default 79.6: an "80 GB" H100's 81,559 MiB, what torch
reports as its total memory; an A100 80GB reports 80) are planned for, computing on CUDA (bf16,
fused AdamW), as the run there would. Prints the peak per GPU, term by term (distributed/memory_plan.py),
whether it fits and, if not, what to change; exits 1 when it does not fit, 2 on bad input. Loads
no weights: the model's config alone (a preset model's published shapes offline).
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf, open_dict

from marl_llm.config import UserError, print_stderr_line

DEFAULT_GPUS = 1
# An "80 GB" H100 as torch.cuda.get_device_properties(...).total_memory and nvidia-smi report it:
# 81,559 MiB (NVML), 79.65 GiB; the product's "80 GB" is not what a run can allocate.
DEFAULT_GPU_GIB = 79.6


def plan_lines(overrides: list[str]) -> tuple[list[str], bool]:
    """(the plan's lines, whether it fits) for marl-llm's `overrides`."""
    from marl_llm.algos import algorithm_class
    from marl_llm.configure import compose_config, validate
    from marl_llm.distributed import memory_plan, placement
    from marl_llm.tasks import build_task

    cfg = compose_config(overrides)
    with open_dict(cfg):
        cfg.run_dir = "/nonexistent/marl-llm-plan"  # validated, never made
    validate(cfg)
    gpus, gib = OmegaConf.select(cfg, "plan.gpus"), OmegaConf.select(cfg, "plan.gpu_gib")
    gpus = DEFAULT_GPUS if gpus is None else int(gpus)  # 0 is refused by validate, not taken for the default
    gib = DEFAULT_GPU_GIB if gib is None else float(gib)
    task = algorithm_class(cfg.algo.name).task_view(build_task(cfg.task), cfg.algo)
    placement.check(cfg, gpus if cfg.trainer.placement != "devices" else 1,
                    placement.policy_count(task.agent_names, cfg.algo), gpus)
    check_model_source(cfg.model)
    try:
        plan = memory_plan.for_config(cfg, tuple(task.agent_names), gpus, int(gib * memory_plan.GiB), "cuda")
    except OSError as err:  # the model's config.json: unreadable, or a hub id not in the cache offline
        raise UserError(f"cannot read the model's config ({' '.join(str(err).split())[:300]}): the plan reads "
                        "config.json of model.path, model.hub_id or model.agent_bases; point it at a checkpoint "
                        "directory or a hub id in the local cache") from None
    return plan.lines(), bool(plan.fits)


def check_model_source(model_cfg) -> None:  # noqa: ANN001  (the config's model section)
    """A model.path or model.agent_bases entry that names no directory (and is no hub id) is refused
    in one line, as the trainer refuses it (models.loading._source), before transformers reads it
    as a hub id and fails with a traceback."""
    from marl_llm.models.loading import _source

    for spec in [None, *(str(s) for s in model_cfg.get("agent_bases") or ())]:
        _source(spec, model_cfg)  # a hub id passes (read from the cache or the hub, as the run reads it)


def override_error(args: list[str]) -> str | None:
    """What marl-llm refuses in its overrides before Hydra composes, in one line (cli/train.py)."""
    from marl_llm.cli.train import grammar_error, lookalike_error, repeated_key_error, unknown_key_error

    return lookalike_error(args) or grammar_error(args) or repeated_key_error(args) or unknown_key_error(args)


def _hydra_line(err: Exception) -> str:
    """Hydra's error as one line: its first ("Error merging override plan.gpus=banana") and the
    cause it prints below ("Value 'banana' of type 'str' could not be converted to Integer")."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    cause = str(err.__cause__).strip().splitlines()[0] if err.__cause__ is not None and str(err.__cause__).strip() \
        else (lines[1] if len(lines) > 1 and not lines[1].startswith(("full_key", "See ")) else "")
    return f"{lines[0] if lines else type(err).__name__}{': ' + cause if cause and cause not in lines[0] else ''}"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return
    from hydra.errors import HydraException

    try:
        err = override_error(argv)
        if err:
            raise UserError(err)
        lines, fits = plan_lines(argv)
    except UserError as err:
        print_stderr_line(f"error: {str(err).splitlines()[0]}")
        sys.exit(2)
    except HydraException as err:
        print_stderr_line(f"error: {_hydra_line(err)}")
        sys.exit(2)
    print("\n".join(lines))
    sys.exit(0 if fits else 1)


if __name__ == "__main__":
    main()
