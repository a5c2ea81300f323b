"""trainer.eval_protocol=paper, the reference trainers' evaluation, beside the project's own: its
schedule and items against comlrl 1.4.3's own MAGRPOTrainer, its rollout (sampled at the training
settings, every turn for MAGRPO, the training rollout for the actor-critic methods), its per-turn
metrics, and the canonical pass@1 ceiling reported with every pass@ metric under the reference
harness."""

from __future__ import annotations

import json

import pytest

from conftest import compose_config, make_policies, tiny_overrides
from marl_llm.training.evaluation import evaluate, paper_eval_due, pass_at_1_ceiling

comlrl_magrpo = pytest.importorskip("comlrl.trainers.reinforce.magrpo")


def comlrl_schedule(model_dir, n_train: int, n_eval: int, epochs: int, interval: int, samples: int):
    """comlrl's own train loop, generation and updates stubbed: the sequence of ("eval", item) and
    ("train", item) events."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.eos_token
    args = comlrl_magrpo.MAGRPOConfig(num_train_epochs=epochs, num_agents=2, num_generations=2, num_turns=1,
                                      eval_interval=interval, eval_num_samples=samples)
    trainer = comlrl_magrpo.MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(model_dir) for _ in range(2)], num_agents=2, tokenizer=tok,
        args=args, reward_func=lambda a, b: [0.0], formatters=[lambda item, external_prompts=None: item["prompt"]] * 2,
        train_dataset=Dataset.from_list([{"prompt": f"t{k}"} for k in range(n_train)]),
        eval_dataset=Dataset.from_list([{"prompt": f"e{k}"} for k in range(n_eval)]))
    events = []
    trainer._train_step_returns = lambda item, **_: events.append(("train", item["prompt"]))
    trainer._evaluate_sample = lambda item, *a: events.append(("eval", item["prompt"]))
    trainer.train()
    return events


@pytest.mark.parametrize("n_train,interval,samples", [(5, 2, 3), (4, 4, 2), (3, 1, 1)])
def test_schedule_and_items_are_comlrls(tiny_model_dir, n_train, interval, samples):
    """Before which steps the paper protocol evaluates, and on which eval items (the first n, in
    order), step for step as comlrl's train loop (batch 0 of every epoch included)."""
    epochs, n_eval = 3, 4
    ref = comlrl_schedule(tiny_model_dir, n_train, n_eval, epochs, interval, samples)
    ours = []
    for step in range(epochs * n_train):
        if paper_eval_due(step, 1, n_train, interval):
            ours += [("eval", f"e{k}") for k in range(min(samples, n_eval))]
        ours.append(("train", f"t{step % n_train}"))
    assert ours == ref
    assert sum(e[0] == "eval" for e in ref) > epochs  # several evaluations per epoch, not one


def test_no_schedule_without_interval():
    assert not any(paper_eval_due(s, 1, 5, 0) for s in range(20))
    assert [s for s in range(12) if paper_eval_due(s, 2, 6, 2)] == [0, 2, 3, 5, 6, 8, 9, 11]


def build(tiny_model_dir, *extra):
    from marl_llm.algos import algorithm_class, build_algorithm
    from marl_llm.rollout.decode import HFRollout
    from marl_llm.tasks import build_task

    cfg = compose_config(["task=humaneval", "task.reward.variant=paper", "algo.sampling.max_new_tokens=6",
                          "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]", "algo.num_turns=2", *extra])
    task = algorithm_class(cfg.algo.name).task_view(build_task(cfg.task), cfg.algo)
    policies = make_policies(tiny_model_dir)
    return cfg, task, build_algorithm(cfg.algo, task, policies, HFRollout(policies), 8)


@pytest.mark.parametrize("algo,as_training", [("magrpo", False), ("collm_cc", True)])
def test_paper_rollout_is_sampled_at_the_training_settings(tiny_model_dir, algo, as_training):
    """One rollout per item at the training temperature: MAGRPO plays every turn (no early
    termination), the actor-critic methods their training rollout (early termination on)."""
    cfg, task, alg = build(tiny_model_dir, f"algo={algo}", "algo.early_termination=-3.5",
                           "trainer.eval_protocol=paper")
    problems = task.load_split("eval")[:2]
    seen = {}
    original = alg.rollout_tree

    def spy(problems_, widths, sampling, terminate=None, *a):
        seen.update(widths=widths, sampling=sampling, terminate=terminate)
        return original(problems_, widths, sampling, terminate, *a)

    alg.rollout_tree = spy
    metrics, rows = evaluate(alg, problems, cfg.trainer)
    assert seen["widths"] == [1, 1] and seen["sampling"] == alg.agent_sampling()
    assert all(s.temperature == cfg.algo.sampling.temperature > 0 for s in seen["sampling"])
    assert (seen["terminate"] is not None) is as_training
    for t in (1, 2):
        if f"turn_{t}/reward" in metrics:
            assert 0.0 <= metrics[f"turn_{t}/test_pass_rate"] <= 1.0
            assert metrics[f"turn_{t}/expected_return"] <= 0.0 or task.reward_shift == 0
    assert "turn_1/reward" in metrics and "reward" in metrics and "pass@1_sampled" in metrics
    assert "pass@1" not in metrics and len(rows) == 2
    assert metrics["pass@1_ceiling"] == 0.5  # HumanEval/1's canonical solution fails the reference harness


def test_expected_return_sums_the_shifted_rewards_from_each_turn(tiny_model_dir):
    """comlrl's eval/turn_<t>/expected_return: turn t's shifted reward plus the later turns'."""
    cfg, task, alg = build(tiny_model_dir, "algo=magrpo", "trainer.eval_protocol=paper")
    problems = task.load_split("eval")[:3]
    tree = alg.rollout_tree(problems, [1, 1], alg.agent_sampling())
    alg.rollout_tree = lambda *a, **k: tree
    metrics, _ = evaluate(alg, problems, cfg.trainer)
    shift = task.reward_shift
    first = [n.reward.total + shift for n in tree.turns[0]]
    second = [n.reward.total + shift for n in tree.turns[1]]
    assert metrics["turn_2/expected_return"] == pytest.approx(sum(second) / 3)
    assert metrics["turn_1/expected_return"] == pytest.approx((sum(first) + sum(second)) / 3)
    rates = [n.reward.info.get("tests_passed", 0) / n.reward.info["tests_total"] if n.reward.info.get("tests_total")
             else 0.0 for n in tree.turns[1]]
    assert metrics["turn_2/test_pass_rate"] == pytest.approx(sum(rates) / 3)


def test_ceiling_follows_the_reward_variant(tiny_model_dir):
    """pass@1_ceiling comes with pass@1 under the reference harness only: on HumanEval test[:32]
    it fails the canonical solutions of HumanEval/1, 6, 10 and 11 (28 / 32)."""
    cfg, task, alg = build(tiny_model_dir, "algo=magrpo")
    problems = task.load_split("eval")
    assert len(problems) == 32
    assert pass_at_1_ceiling(task, problems) == 28 / 32
    assert pass_at_1_ceiling(task, problems[:4]) == 0.75
    metrics, _ = evaluate(alg, problems[:2], cfg.trainer)  # the own protocol: greedy pass@1
    assert "pass@1" in metrics and metrics["pass@1_ceiling"] == 0.5
    cfg, task, alg = build(tiny_model_dir, "algo=magrpo", "task.reward.variant=fixed")
    assert pass_at_1_ceiling(task, problems[:4]) is None
    assert "pass@1_ceiling" not in evaluate(alg, task.load_split("eval")[:2], cfg.trainer)[0]


def test_trainer_evaluates_on_the_reference_schedule(tiny_model_dir, tmp_path):
    """Through the console script: 2 training problems, eval_interval 2 over 4 steps (2 epochs):
    evaluations before steps 0 and 2 (batch 0 of each epoch) on the first eval_max_problems items,
    and none after training with trainer.eval_after=false, as the paper presets set it (comlrl's
    loop ends with its last batch); eval_every and eval_before are not used."""
    import subprocess

    from conftest import VENV_BIN

    run_dir = tmp_path / "run"
    args = tiny_overrides(tiny_model_dir, run_dir, "task.data.train_split='test[33:35]'", "trainer.max_steps=4",
                          "trainer.eval_protocol=paper", "trainer.eval_interval=2", "trainer.eval_max_problems=1",
                          "trainer.eval_every=1", "trainer.eval_before=false", "trainer.eval_after=false",
                          "task.reward.variant=paper")
    out = subprocess.run([str(VENV_BIN / "marl-llm"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward" in r]
    # Due before steps 0 and 2 (batch 0 of each epoch, interval 2); none after the last step.
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert {"eval/turn_1/reward", "eval/turn_1/test_pass_rate", "eval/turn_1/expected_return",
                "eval/pass@1_sampled", "eval/pass@1_ceiling"} <= set(r)
        assert "eval/pass@1" not in r
    assert "ceiling" in out.stderr + out.stdout
    assert "held-out before training (none after it: trainer.eval_after=false)" in out.stderr + out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["after"] is None and summary["before"]["reward"] == evals[0]["eval/reward"]


def test_in_order_data_is_comlrls_and_shuffle_is_not(tiny_model_dir):
    """trainer.data_order=in_order walks the training set in its order every epoch, as comlrl's
    train loop (DataLoader shuffle=False); marl-llm's default shuffles each epoch."""
    from marl_llm.tasks.base import Problem
    from marl_llm.training.data_order import batch_for_step

    events = comlrl_schedule(tiny_model_dir, 5, 1, 3, 0, 1)
    ref = [item for kind, item in events if kind == "train"]
    problems = [Problem(f"t{k}", {}) for k in range(5)]
    assert [p.uid for s in range(15) for p in batch_for_step(problems, s, 1, 7, "in_order")] == ref
    assert [p.uid for s in range(5) for p in batch_for_step(problems, s, 3, 7, "in_order")] == ref
    assert [p.uid for s in range(15) for p in batch_for_step(problems, s, 1, 7)] != ref
    keys = [p.sample_key for s in range(3) for p in batch_for_step(problems, s, 1, 7, "in_order")]
    assert keys == [p.sample_key for s in range(3) for p in batch_for_step(problems, s, 1, 7)]  # same draws


def test_unapplied_generation_settings_are_named_once(tiny_model_dir, caplog):
    """algo.sampling.top_k=null reads the generation config as the references' generate(); a setting
    of it that generate() would apply and marl-llm's sampler does not (repetition_penalty) is named
    in one warning per model; nothing with top_k set or a plain config."""
    import logging

    from marl_llm.algos import build_algorithm
    from marl_llm.algos.base import unapplied_generation_settings
    from marl_llm.rollout.decode import HFRollout
    from marl_llm.tasks import build_task

    cfg = compose_config(["task=humaneval", "algo=magrpo", "algo.sampling.top_k=null"])
    policies = make_policies(tiny_model_dir)
    model = policies.models[0]
    assert unapplied_generation_settings(model) == {}
    model.generation_config.repetition_penalty = 1.05
    model.generation_config.top_k = 20
    assert unapplied_generation_settings(model) == {"repetition_penalty": 1.05}
    algo = build_algorithm(cfg.algo, build_task(cfg.task), policies, HFRollout(policies), 8)
    with caplog.at_level(logging.WARNING, logger="marl_llm"):
        sampling = algo.agent_sampling()
        algo.agent_sampling()
    assert [s.top_k for s in sampling] == [20, 20]
    warnings = [r.getMessage() for r in caplog.records if "repetition_penalty=1.05" in r.getMessage()]
    assert len(warnings) == 1 and "does not" in warnings[0]
    caplog.clear()
    cfg = compose_config(["task=humaneval", "algo=magrpo", "algo.sampling.top_k=0"])
    other = make_policies(tiny_model_dir)
    other.models[0].generation_config.repetition_penalty = 1.05
    with caplog.at_level(logging.WARNING, logger="marl_llm"):
        build_algorithm(cfg.algo, build_task(cfg.task), other, HFRollout(other), 8).agent_sampling()
    assert not caplog.records
