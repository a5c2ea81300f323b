"""The training loop on the tiny model and the real HumanEval task: seeded determinism, exact
resume from a checkpoint, metric names, data order."""

from __future__ import annotations

import json

import torch

from conftest import compose_config, tiny_overrides
from marl_llm.tasks.base import Problem
from marl_llm.training.data_order import batch_for_step
from marl_llm.training.trainer import train


def metrics(run_dir, split="train"):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if any(k.startswith(f"{split}/") for k in r)]


def adapters(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["adapters"]


def trained(state):
    """LoRA B matrices start at zero: any nonzero one means the run really changed its adapters."""
    return any(float(t.abs().max()) > 0 for a in state.values() for n, t in a.items() if "lora_B" in n)


def same_adapters(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])


def test_batches_cover_every_problem_each_epoch_and_depend_only_on_step():
    probs = [Problem(str(i), {}) for i in range(7)]
    epoch = [p.uid for s in range(7) for p in batch_for_step(probs, s, 1, seed=0)]
    assert sorted(epoch) == sorted(p.uid for p in probs)
    assert [p.uid for p in batch_for_step(probs, 3, 2, 0)] == [p.uid for p in batch_for_step(probs, 3, 2, 0)]
    assert epoch != [p.uid for s in range(7) for p in batch_for_step(probs, s, 1, seed=1)]


def test_same_seed_same_run(tiny_model_dir, tmp_path):
    runs = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        train(compose_config(tiny_overrides(tiny_model_dir, run_dir, "trainer.max_steps=2", "trainer.eval_before=false",
                                            "algo.baseline=raw", "trainer.deterministic=true")))  # nonzero advantages: the adapters move
        runs.append(run_dir)
    ma, mb = metrics(runs[0]), metrics(runs[1])
    drop = ("step_time", "perf/", "timing/")
    strip = [{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in ma + mb]
    assert strip[: len(ma)] == strip[len(ma):]
    assert trained(adapters(runs[0])) and same_adapters(adapters(runs[0]), adapters(runs[1]))


def test_resume_continues_exactly(tiny_model_dir, tmp_path):
    straight = tmp_path / "straight"
    train(compose_config(tiny_overrides(tiny_model_dir, straight, "trainer.max_steps=2", "trainer.eval_before=false",
                                        "trainer.eval_after=false", "algo.baseline=raw", "trainer.deterministic=true")))
    split = tmp_path / "split"
    train(compose_config(tiny_overrides(tiny_model_dir, split, "trainer.max_steps=1", "trainer.eval_before=false",
                                        "trainer.eval_after=false", "algo.baseline=raw", "trainer.deterministic=true")))
    ckpt = torch.load(split / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 1 and {"adapters", "optimizers", "rng", "config", "wandb_id"} <= set(ckpt)
    train(compose_config(tiny_overrides(tiny_model_dir, split, "trainer.max_steps=2", "trainer.eval_before=false",
                                        "trainer.eval_after=false", "algo.baseline=raw", "trainer.resume=true",
                                        "trainer.deterministic=true")))
    assert [r["step"] for r in metrics(split)] == [1, 2]
    assert trained(adapters(straight)) and same_adapters(adapters(straight), adapters(split))
    last_a, last_b = metrics(straight)[-1], metrics(split)[-1]
    assert last_a["train/reward"] == last_b["train/reward"] and last_a["train/aux/loss"] == last_b["train/aux/loss"]


def test_metric_names_follow_trl_with_agent_and_turn_segments(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    train(compose_config(tiny_overrides(tiny_model_dir, run_dir, "algo.kl_coef=0.05", "algo.kl_mode=loss",
                                        "trainer.eval_num_samples=2", "trainer.eval_k=[1,2]")))
    train_row = metrics(run_dir)[0]
    for name in ["reward", "reward_std", "frac_reward_zero_std", "turn_1/reward", "turn_2/reward",
                 "rewards/structure/mean", "rewards/tests/std", "loss", "grad_norm", "entropy", "kl",
                 "learning_rate", "num_tokens", "completions/mean_length", "completions/min_length",
                 "completions/max_length", "completions/clipped_ratio", "clip_ratio/region_mean", "step_time",
                 "perf/throughput", "perf/time_per_step", "aux/loss", "main/kl", "aux/entropy",
                 "main/completions/mean_length"]:
        assert f"train/{name}" in train_row, name
    eval_rows = metrics(run_dir, "eval")
    assert len(eval_rows) == 2  # before and after
    for name in ["pass@1", "reward", "turn_1/pass@1", "turn_2/pass@1", "rewards/structure/rate", "pass@2",
                 "pass@1_sampled", "reward_sampled"]:
        assert f"eval/{name}" in eval_rows[0], name
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {"aux/completion", "main/completion", "reward", "levels"} <= set(samples[0])
    assert json.loads((run_dir / "summary.json").read_text())["after"]["pass@1"] >= 0


def test_cross_mode_and_ppo_options_train(tiny_model_dir, tmp_path):
    train(compose_config(tiny_overrides(tiny_model_dir, tmp_path / "cross", "algo.joint_mode=cross", "algo.num_turns=1",
                                        "trainer.eval_before=false", "trainer.eval_after=false")))
    rows = metrics(tmp_path / "cross")
    assert rows[0]["train/aux/num_tokens"] > 0 and "train/turn_2/reward" not in rows[0]
    train(compose_config(tiny_overrides(tiny_model_dir, tmp_path / "ppo", "algo.clip_eps=0.2", "algo.ppo_epochs=2",
                                        "algo.loss_aggregation=token_mean", "algo.kl_coef=0.1",
                                        "trainer.eval_before=false", "trainer.eval_after=false")))
    row = metrics(tmp_path / "ppo")[0]
    assert 0.0 <= row["train/clip_ratio/region_mean"] <= 1.0
