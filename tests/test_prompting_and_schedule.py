"""model.chat_template / chat_template_kwargs (checked against the tokenizer) and algo.lr_scheduler."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from marl_llm.algos.update import lr_schedulers
from marl_llm.config import UserError
from marl_llm.models.prompting import PromptFormat, encode_prompt, prompt_format, template_variables

THINKING_TEMPLATE = ("{% for m in messages %}<|u|>{{ m['content'] }}{% endfor %}"
                     "{% if add_generation_prompt %}<|a|>{% if enable_thinking is defined and not enable_thinking %}"
                     "NOTHINK{% endif %}{% endif %}")


@pytest.fixture()
def tokenizer():
    from transformers import AutoTokenizer

    from marl_llm.models.loading import embedded_checkpoint

    return AutoTokenizer.from_pretrained(embedded_checkpoint())


def test_auto_true_false(tokenizer):
    assert prompt_format(tokenizer, "auto", {}, "m") == PromptFormat(True)
    assert prompt_format(tokenizer, True, {}, "m") == PromptFormat(True)
    raw = prompt_format(tokenizer, False, {}, "m")
    tokenizer.prompt_format = raw
    assert encode_prompt(tokenizer, "hello world") == tokenizer("hello world")["input_ids"]
    tokenizer.prompt_format = PromptFormat(True)
    templated = encode_prompt(tokenizer, "hello world")
    assert len(templated) > len(tokenizer("hello world")["input_ids"])
    assert "hello world" in tokenizer.decode(templated)


def test_true_without_template_names_the_fix(tokenizer):
    tokenizer.chat_template = None
    assert prompt_format(tokenizer, "auto", {}, "m") == PromptFormat(False)
    with pytest.raises(UserError, match="model.chat_template=false"):
        prompt_format(tokenizer, True, {}, "base-model")


def test_template_options_are_checked_and_passed(tokenizer):
    with pytest.raises(UserError, match="enable_thinking"):  # SmolLM2's template has no thinking switch
        prompt_format(tokenizer, True, {"enable_thinking": False}, "SmolLM2")
    with pytest.raises(UserError, match="need a chat template"):
        prompt_format(tokenizer, False, {"enable_thinking": False}, "m")
    tokenizer.chat_template = THINKING_TEMPLATE
    assert "enable_thinking" in template_variables(THINKING_TEMPLATE)
    tokenizer.prompt_format = prompt_format(tokenizer, True, {"enable_thinking": False}, "m")
    assert tokenizer.decode(encode_prompt(tokenizer, "hi")).endswith("NOTHINK")
    tokenizer.prompt_format = prompt_format(tokenizer, True, {}, "m")
    assert not tokenizer.decode(encode_prompt(tokenizer, "hi")).endswith("NOTHINK")


def test_config_rejects_bad_chat_template_values():
    from conftest import compose_config
    from marl_llm.configure import validate

    with pytest.raises(UserError, match="model.chat_template"):
        validate(compose_config(["model.chat_template=maybe", "run_dir=/tmp/x"]))


def _optimizer(lr=1.0):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_cosine_schedule_is_verls():
    cfg = OmegaConf.create({"lr_scheduler": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.3})
    opt = _optimizer(2.0)
    [sched] = lr_schedulers([opt], cfg, max_steps=110)
    lrs = []
    for _ in range(111):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    assert lrs[0] == pytest.approx(2.0 * 0.3)  # warm-up starts at the floor (verl), not at 0
    assert lrs[5] == pytest.approx(2.0 * (0.3 + 0.7 * 0.5))
    assert lrs[10] == pytest.approx(2.0)
    assert lrs[60] == pytest.approx(2.0 * (0.3 + 0.7 * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert lrs[110] == pytest.approx(2.0 * 0.3)
    assert lr_schedulers([_optimizer()], OmegaConf.create({"lr_scheduler": "constant"}), 10) == []


def test_resumed_schedule_fast_forwards_from_the_restored_optimizer():
    cfg = OmegaConf.create({"lr_scheduler": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1})
    opt = _optimizer(1e-3)
    [sched] = lr_schedulers([opt], cfg, max_steps=20)
    for _ in range(7):
        sched.step()
    saved = opt.state_dict()
    resumed = _optimizer(1e-3)
    lr_schedulers([resumed], cfg, max_steps=20)  # built before the checkpoint loads, as in train()
    resumed.load_state_dict(saved)
    [again] = lr_schedulers([resumed], cfg, max_steps=20, start_step=7)
    assert resumed.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    sched.step(), again.step()
    assert resumed.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_top_k_null_is_the_models_generation_default(tiny_model_dir):
    """algo.sampling.top_k=null: what generate() would use when the reference passes top_k=None."""
    from conftest import compose_config, make_policies
    from marl_llm.algos import build_algorithm
    from marl_llm.rollout.decode import HFRollout
    from test_magrpo_vs_comlrl import PathTask

    cfg = compose_config(["algo=magrpo", "algo.sampling.top_k=null", "run_dir=/tmp/x"])
    policies = make_policies(tiny_model_dir)
    algo = build_algorithm(cfg.algo, PathTask(), policies, HFRollout(policies), 4)
    model = policies.models[0]
    assert model.generation_config.top_k is None  # the tiny model's generation config sets none
    assert [p.top_k for p in algo.agent_sampling()] == [50, 50]  # transformers' global default
    model.generation_config.top_k = 20  # e.g. Qwen3's generation_config.json
    assert [p.top_k for p in algo.agent_sampling()] == [20, 20]


def test_message_with_system_part_or_sent_raw(tokenizer):
    import pickle

    from marl_llm.models.prompting import Message

    tokenizer.prompt_format = PromptFormat(True)
    with_system = tokenizer.decode(encode_prompt(tokenizer, Message("build it", system="You are a builder.")))
    assert with_system.index("You are a builder.") < with_system.index("build it")
    plain = tokenizer.decode(encode_prompt(tokenizer, "build it"))
    assert "You are a builder." not in plain
    raw = Message("turn two text", raw=True)
    assert encode_prompt(tokenizer, raw) == tokenizer("turn two text")["input_ids"]
    assert raw == "turn two text" and raw + "!" == "turn two text!"  # a str everywhere else
    again = pickle.loads(pickle.dumps(Message("x", system="s", raw=True)))
    assert (again, again.system, again.raw) == ("x", "s", True)
