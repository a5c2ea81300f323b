"""The CUDA path's correctness switches, exercised on the CPU with the same code: bf16 compute
over fp32 master weights (CPU autocast runs exactly the branch CUDA runs), the separate critic,
gradient checkpointing, fp16 refusal and deterministic mode."""

from __future__ import annotations

import collections
import os

import pytest
import torch

from conftest import TEST_DEVICE, compose_config, tiny_overrides
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.models.policies import master_weights_dtype
from marl_llm.training.setup import build, gradient_checkpointing, seed_everything
from test_collm import overrides as collm_overrides


def collm_separate(model_dir, run_dir, *extra):
    cfg = compose_config(collm_overrides(model_dir, run_dir, "collm_cc", "strbuild", "algo.critic.placement=separate",
                                         f"model.device={TEST_DEVICE}", *extra))
    validate(cfg)
    return build(cfg)


def test_bf16_adamw_rounds_away_the_presets_updates_which_fp32_master_weights_keep():
    """The failure the separate critic had: at lr 5e-6, AdamW steps on bf16 weights round away
    (all but the weights nearest zero stay put), where fp32 weights all move."""
    torch.manual_seed(0)
    w = torch.randn(256, 256) * 0.02
    moved = {}
    for dtype in (torch.bfloat16, torch.float32):
        p = torch.nn.Parameter(w.to(dtype).clone())
        opt = torch.optim.AdamW([p], lr=5e-6, weight_decay=0.0)
        start = p.detach().clone()
        for _ in range(10):
            p.grad = torch.randn_like(p)
            opt.step()
        moved[dtype] = float((p.detach() != start).float().mean())
    assert moved[torch.bfloat16] < 0.15 and moved[torch.float32] > 0.99


def test_separate_critic_keeps_fp32_master_weights_and_computes_in_bf16(tiny_model_dir, tmp_path):
    run = collm_separate(tiny_model_dir, tmp_path, "model.dtype=bfloat16")
    critic = run.algo.critics[0]
    assert master_weights_dtype(run.policies.device, torch.bfloat16) == torch.bfloat16
    assert critic.adapter is None and all(p.dtype == torch.float32 for p in critic.trunk.values())
    prompt = [torch.tensor([1, 5, 6, 7])]
    q_proj = [m for n, m in critic.model.named_modules() if n.endswith("q_proj")][0]
    seen = []
    handle = q_proj.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    with torch.no_grad():
        critic.model(input_ids=prompt[0][None].to(run.policies.device))
    handle.remove()
    assert seen == [torch.bfloat16]  # the forward pass ran under autocast
    before = {k: p.detach().clone() for k, p in critic.trunk.items()}
    for g in critic.optimizer.param_groups:
        g["lr"] = 5e-6  # the presets' critic learning rate
    for _ in range(3):
        critic.update(prompt * 2, None, torch.tensor([1.0, -1.0]), torch.zeros(2))
    changed = [float((p.detach() != before[k]).float().mean()) for k, p in critic.trunk.items() if p.numel() > 1]
    assert min(changed) > 0.5, changed  # every weight matrix moved: fp32 masters keep the small steps
    state = critic.optimizer.state
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())


def test_lora_adapters_stay_fp32_and_run_under_bf16_autocast(tiny_model_dir, tmp_path):
    cfg = compose_config(tiny_overrides(tiny_model_dir, tmp_path, "model.dtype=bfloat16"))
    validate(cfg)
    run = build(cfg)
    p = run.policies
    assert p.autocast_dtype == torch.bfloat16
    model = p.models[0]
    lora_a = [m for n, m in model.named_modules() if n.endswith("lora_A.agent_aux")][0]
    assert lora_a.weight.dtype == torch.float32
    seen = []
    handle = lora_a.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    with p.acting(0) as m:
        m(input_ids=torch.tensor([[1, 5, 6]], device=p.device)).logits.float().sum().backward()
    handle.remove()
    assert seen == [torch.bfloat16]  # the adapter's matmul ran in bf16 (tensor cores on CUDA)
    assert lora_a.weight.grad is not None and lora_a.weight.grad.dtype == torch.float32


def test_gradient_checkpointing_reaches_the_separate_critic(tiny_model_dir, tmp_path):
    run = collm_separate(tiny_model_dir, tmp_path, "trainer.gradient_checkpointing=true")
    assert run.algo.extra_models() == [run.algo.critics[0].model]
    assert run.algo.critics[0].model.is_gradient_checkpointing
    assert all(m.is_gradient_checkpointing for m in run.policies.models)


def test_gradient_checkpointing_auto_is_for_large_bases_on_cuda():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gradient_checkpointing("auto", cuda, int(8e9)) and gradient_checkpointing("auto", cuda, int(4e9))
    assert not gradient_checkpointing("auto", cuda, int(3e9)) and not gradient_checkpointing("auto", cpu, int(8e9))
    assert gradient_checkpointing(True, cpu, 1) and not gradient_checkpointing(False, cuda, int(8e9))
    cfg = compose_config(["trainer.gradient_checkpointing=sometimes", "run_dir=/tmp/x"])
    with pytest.raises(UserError, match=r"trainer\.gradient_checkpointing"):
        validate(cfg)


def test_gradient_checkpointing_is_auto_by_default_so_the_8b_presets_get_it_on_cuda():
    assert compose_config(["run_dir=/tmp/x"]).trainer.gradient_checkpointing == "auto"
    assert gradient_checkpointing("auto", torch.device("cuda"), int(8.2e9))  # Qwen3-8B's parameters
    assert not gradient_checkpointing("auto", torch.device("cpu"), int(8.2e9))
    # The 8B presets get it on CUDA without trainer=gpu (they set it outright: their memory plan counts on it).
    for preset in ("at_grpo_plan_path_qwen3_8b_paper", "at_grpo_sokoban_qwen3_8b_paper"):
        setting = compose_config([f"experiment={preset}", "run_dir=/tmp/x"]).trainer.gradient_checkpointing
        assert setting in ("auto", True) and gradient_checkpointing(setting, torch.device("cuda"), int(8.2e9)), preset


def test_gpu_trainer_preset_sizes_for_a_gpu_and_yields_to_a_paper_preset():
    cfg = compose_config(["trainer=gpu", "run_dir=/tmp/x"])
    validate(cfg)
    assert cfg.trainer.sequences_per_generate == 64 and cfg.trainer.gradient_checkpointing == "auto"
    assert cfg.trainer.eval_max_problems is None
    # A preset's own sizes win (the experiment composes after the trainer group).
    preset = compose_config(["trainer=gpu", "experiment=collm_cc_tldr_paper", "run_dir=/tmp/x"])
    plain = compose_config(["experiment=collm_cc_tldr_paper", "run_dir=/tmp/x"])
    assert preset.trainer.completions_per_micro_batch == plain.trainer.completions_per_micro_batch != 16


def test_fp16_training_is_refused_with_the_fix_but_fp16_evaluation_runs(tiny_model_dir, tmp_path):
    cfg = compose_config(tiny_overrides(tiny_model_dir, tmp_path, "model.dtype=float16"))
    with pytest.raises(UserError, match="model.dtype=bfloat16"):
        build(cfg)
    cfg = compose_config(tiny_overrides(tiny_model_dir, tmp_path, "model.dtype=float16", "trainer.max_steps=0"))
    assert build(cfg).policies.dtype == torch.float16


def test_deterministic_mode_sets_cublas_workspace_before_cuda_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        seed_everything(0, deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.utils.deterministic.fill_uninitialized_memory  # no NaN fill of every torch.empty
        seed_everything(0, deterministic=False)
        assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    finally:
        seed_everything(0, deterministic=False)


def test_deterministic_mode_asks_flash_attention_for_its_deterministic_backward(monkeypatch):
    """torch's deterministic mode does not reach the flash-attn extension: transformers passes
    flash-attention 2 `deterministic=True` only under FLASH_ATTENTION_DETERMINISTIC=1, which
    trainer.deterministic sets (its flash kwargs are built here with every feature supported, as
    an installed flash-attn >= 2.4.1 reports)."""
    from transformers.modeling_flash_attention_utils import _process_flash_attention_kwargs

    supported = collections.defaultdict(lambda: True)

    def flash_kwargs():
        return _process_flash_attention_kwargs(4, 4, is_causal=True, supports_mapping=supported)

    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    assert flash_kwargs()["deterministic"] is False  # flash-attn's default: a backward whose sums vary
    try:
        seed_everything(0, deterministic=True)
        assert flash_kwargs()["deterministic"] is True
    finally:
        seed_everything(0, deterministic=False)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="checks the CPU default of the test switch")
def test_the_test_device_switch_defaults_to_the_cpu(tiny_model_dir, tmp_path):
    cfg = compose_config(tiny_overrides(tiny_model_dir, tmp_path))
    assert cfg.model.device == "cpu"


def test_adamw_is_fused_on_cuda_and_keeps_the_runs_choice_on_resume(tiny_model_dir, tmp_path):
    from marl_llm.models.policies import adamw_kwargs, restore_implementation

    assert adamw_kwargs({"cuda"}) == {"fused": True}
    assert adamw_kwargs({"cpu"}) == {} and adamw_kwargs({"cpu", "cuda"}) == {}
    cfg = compose_config(tiny_overrides(tiny_model_dir, tmp_path))
    validate(cfg)
    run = build(cfg)
    fused = run.policies.device.type == "cuda"
    for opt in run.policies.optimizers.values():
        assert bool(opt.defaults["fused"]) == fused and bool(opt.param_groups[0]["fused"]) == fused
        saved = opt.state_dict()
        saved["param_groups"][0]["fused"] = not fused  # a checkpoint of the other kind of run
        restore_implementation(opt, saved)
        assert bool(opt.param_groups[0]["fused"]) == fused


def test_a_rebuilt_adamw_takes_the_implementation_of_its_new_parameters_device():
    """FSDP rebuilds the optimizers over the shards (`same_optimizer`), which live on the GPU
    though the model loaded on the CPU: the rebuilt AdamW is chosen for the shards' device, not
    copied from the first one. Here the first is fused (torch has a fused CPU kernel) and the
    shards are on the CPU, where the project's choice is torch's default; a fused AdamW over
    DTensor shards steps as the foreach one does: test_sharded_loading.py."""
    from marl_llm.models.policies import same_optimizer

    params = [torch.nn.Parameter(torch.randn(3, 2))]
    first = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
    rebuilt = same_optimizer(first, params)
    assert isinstance(rebuilt, torch.optim.AdamW) and not rebuilt.defaults["fused"]
    assert (rebuilt.defaults["lr"], rebuilt.defaults["weight_decay"]) == (1e-3, 0.1)


def test_gradients_are_freed_after_the_optimizer_step(tiny_model_dir, tmp_path):
    """The update's gradients do not live on through the next rollout (their memory is the
    rollout's KV cache's on a GPU)."""
    from marl_llm.training.trainer import train_step

    cfg = compose_config(tiny_overrides(tiny_model_dir, tmp_path, "trainer.eval_before=false"))
    validate(cfg)
    run = build(cfg)
    seen = []
    for opt in run.policies.optimizers.values():  # gradients existed when the step ran
        opt.register_step_pre_hook(lambda o, *_: seen.append(sum(p.grad is not None for g in o.param_groups
                                                                 for p in g["params"])))
    train_step(run, cfg, 0)
    assert seen and min(seen) > 0
    assert all(p.grad is None for p in run.policies.trainable_parameters())


def test_deterministic_updates_run_in_strict_mode_and_name_an_op_without_a_kernel(tiny_model_dir, tmp_path):
    """trainer.deterministic=true: warn-only mode for the run, strict mode in the update (what makes
    SDPA's memory-efficient backward deterministic on CUDA; tests/test_trainer.py checks that two
    such runs give bitwise-equal adapters). An op without a deterministic kernel stops the update
    with one line that names it and the fix."""
    from marl_llm.training.setup import strict_determinism
    from marl_llm.training.trainer import train_step

    cfg = compose_config(tiny_overrides(tiny_model_dir, tmp_path, "trainer.eval_before=false",
                                        "trainer.deterministic=true", "algo.baseline=raw"))
    validate(cfg)
    try:
        seed_everything(0, deterministic=True)
        run = build(cfg)
        modes = []
        for opt in run.policies.optimizers.values():
            opt.register_step_pre_hook(lambda *_: modes.append(torch.is_deterministic_algorithms_warn_only_enabled()))
        train_step(run, cfg, 0)
        assert modes and not any(modes)  # strict while stepping
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        with pytest.raises(UserError, match=r"^trainer.deterministic=true: index_reduce_cuda has no deterministic "
                                            r"kernel .* set trainer.deterministic=false"):
            with strict_determinism(True):
                raise RuntimeError("index_reduce_cuda does not have a deterministic implementation, but you set "
                                   "'torch.use_deterministic_algorithms(True)'. ...")
        with pytest.raises(RuntimeError, match="something else"), strict_determinism(True):
            raise RuntimeError("something else")
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        seed_everything(0, deterministic=False)
