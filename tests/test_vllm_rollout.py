"""The vLLM rollout backend and the sampler/trainer log-prob correction (truncated importance
sampling).

vLLM cannot run here (no GPU, not installed): the backend is driven by a stand-in `vllm` package
put into sys.modules, which records every call (engine arguments, wake/sleep, generate with its
LoRA requests and sampling parameters) and answers with scripted tokens and log-probs. The
importance weighting itself runs on the real tiny model.
"""

from __future__ import annotations

import gc
import json
import math
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from conftest import FLOAT64_REL, assert_close_to_scale, compose_config, make_policies, tiny_overrides
from marl_llm.algos.losses import policy_loss
from marl_llm.algos.update import UpdateSettings, micro_batches, policy_update
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.models.prompting import encode_prompt
from marl_llm.rollout.base import Completion, GenRequest
from marl_llm.rollout.decode import completion_logprobs, to_completion
from marl_llm.rollout.sampling import SamplingParams
from marl_llm.rollout import vllm as vllm_rollout
from marl_llm.rollout.vllm import VLLM_LORA_RANKS, VLLMRollout, allowed_lora_ranks, max_lora_rank


# ------------------------------------------------------------------------ the stand-in vllm
@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    stop_reason: Any = None


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]


@dataclass
class Script:
    """What the stand-in engine answers: reply(prompt ids, params, lora) -> (token ids, log-probs,
    finish reason, stop reason); default: max_tokens seeded ids with log-prob -1 each."""

    events: list[tuple] = field(default_factory=list)
    reply: Any = None


def default_reply(prompt, params, lora):
    gen = torch.Generator().manual_seed(params.seed or 0)
    ids = torch.randint(100, 1000, (params.max_tokens,), generator=gen).tolist()
    return ids, [-1.0] * len(ids), "length", None


def stand_in_vllm(script: Script, ranks=(8, 16, 32)) -> dict[str, types.ModuleType]:
    """Modules of a minimal `vllm` with the API VLLMRollout uses, recording into script.events."""
    vllm = types.ModuleType("vllm")

    @dataclass
    class EngineArgs:  # only the field VLLMRollout asks about
        model: str = ""
        logprobs_mode: str = "raw_logprobs"

    class SamplingParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)
            self.kwargs = kwargs

    class LLM:
        def __init__(self, **kwargs):
            script.events.append(("init", kwargs))

        def sleep(self, level=1):
            script.events.append(("sleep", level))

        def wake_up(self, tags=None):
            script.events.append(("wake_up", tags))

        def generate(self, prompts, sampling_params, lora_request, use_tqdm=True):
            # The exported adapter must be on disk when vLLM is asked to load it.
            assert all((Path(r.lora_path) / "adapter_config.json").exists() for r in lora_request)
            script.events.append(("generate", [r.lora_int_id for r in lora_request], [r.lora_name for r in lora_request],
                                  [p.kwargs for p in sampling_params]))
            outs = []
            for prompt, params, lora in zip(prompts, sampling_params, lora_request):
                ids, logps, finish, stop = (script.reply or default_reply)(prompt["prompt_token_ids"], params, lora)
                steps = [{t: Logprob(lp)} for t, lp in zip(ids, logps)]
                outs.append(RequestOutput([CompletionOutput(ids, steps, finish, stop)]))
            return outs

    @dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str

    vllm.EngineArgs, vllm.SamplingParams, vllm.LLM = EngineArgs, SamplingParams, LLM
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    config, config_lora = types.ModuleType("vllm.config"), types.ModuleType("vllm.config.lora")
    config_lora.MaxLoRARanks = Literal[ranks]
    vllm.lora, lora.request, vllm.config, config.lora = lora, request, config, config_lora
    return {"vllm": vllm, "vllm.lora": lora, "vllm.lora.request": request, "vllm.config": config,
            "vllm.config.lora": config_lora}


@pytest.fixture
def script(monkeypatch) -> Script:
    """A stand-in vllm on a machine that says it has CUDA (only vllm_rollout's own check)."""
    s = Script()
    for name, module in stand_in_vllm(s).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vllm_rollout, "_has_cuda", lambda: True)
    return s


def names(events):
    return [e[0] for e in events]


# ------------------------------------------------------------------------------ LoRA rank
def test_max_lora_rank_rounds_up_to_the_next_allowed_rank():
    assert max_lora_rank([4]) == 8
    assert max_lora_rank([8, 4]) == 8
    assert max_lora_rank([9, 2]) == 16
    assert max_lora_rank([1]) == 1
    assert max_lora_rank([300]) == 320
    assert max_lora_rank([512]) == 512
    assert max_lora_rank([3], allowed=(32, 8, 16)) == 8  # any order
    with pytest.raises(UserError, match=r"algo.lora.r<=512 or use trainer.rollout=hf"):
        max_lora_rank([513])
    with pytest.raises(UserError, match=r"algo.lora.r<=16"):
        max_lora_rank([17], allowed=(8, 16))


def test_allowed_ranks_are_read_from_the_installed_vllm(monkeypatch):
    for name, module in stand_in_vllm(Script(), ranks=(16, 8, 64)).items():
        monkeypatch.setitem(sys.modules, name, module)
    assert allowed_lora_ranks() == (8, 16, 64)
    monkeypatch.delattr(sys.modules["vllm.config.lora"], "MaxLoRARanks")
    assert allowed_lora_ranks() == VLLM_LORA_RANKS


# ---------------------------------------------------------------------- the rollout backend
def eos_script(eos: int):
    """Request 0 returns its EOS (log-prob included), request 1 stops on an EOS vLLM leaves out,
    request 2 hits max_tokens."""
    replies = {
        0: ([11, 12, eos, 13], [-0.5, -1.5, -0.25, -9.0], "stop", eos),
        1: ([21, 22], [-0.7, -0.9], "stop", eos),
    }

    def reply(prompt, params, lora):
        if params.seed in replies:
            return replies[params.seed]
        ids = list(range(31, 31 + params.max_tokens))
        return ids, [-0.1 * (k + 1) for k in range(len(ids))], "length", None
    return reply


def test_stand_in_vllm_wake_generate_sleep_lora_ids_logprobs_and_cleanup(tiny_model_dir, tmp_path, script):
    policies = make_policies(tiny_model_dir)  # LoRA r=4, adapters agent_aux and agent_main
    eos = policies.eos_ids[0][0]
    script.reply = eos_script(eos)
    root = tmp_path / "run" / "vllm_adapters"
    rollout = VLLMRollout(policies, 0.3, sleep=True, root=root)

    (_, init), = [e for e in script.events if e[0] == "init"]
    assert init["max_lora_rank"] == 8 and init["max_loras"] == 2 and init["enable_lora"] is True
    assert init["enable_sleep_mode"] is True and init["logprobs_mode"] == "raw_logprobs"
    assert init["gpu_memory_utilization"] == 0.3 and init["model"] == str(tiny_model_dir)
    assert names(script.events) == ["init", "sleep"] and script.events[1][1] == 1  # asleep until a rollout
    export = root / "rank0"
    assert sorted(p.name for p in export.iterdir()) == ["agent_aux-v1", "agent_main-v1"]

    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5)
    requests = [GenRequest(0, "a", sp, key=0), GenRequest(1, "b", sp, key=1), GenRequest(0, "c", sp, key=2)]
    out = rollout.generate(requests)
    out2 = rollout.generate(requests[:1])  # still in the rollout phase: no second wake
    rollout.release()
    rollout.release()  # asleep already: nothing more
    assert names(script.events) == ["init", "sleep", "wake_up", "generate", "generate", "sleep"]
    _, ids_v1, lora_names, params = script.events[3]
    assert lora_names == ["agent_aux-v1", "agent_main-v1", "agent_aux-v1"] and ids_v1[0] == ids_v1[2] != ids_v1[1]
    assert all(p["logprobs"] == 0 and p["top_k"] == -1 and p["stop_token_ids"] == policies.eos_ids[0] for p in params)
    assert [p["seed"] for p in params] == [0, 1, 2]

    # Log-probs follow the completion's cut: through the first EOS; an EOS vLLM left out gets NaN.
    assert out[0].completion_ids.tolist() == [11, 12, eos]
    assert out[0].rollout_logprobs.tolist() == [-0.5, -1.5, -0.25]
    assert out[1].completion_ids.tolist() == [21, 22, eos] and not out[1].truncated
    assert out[1].rollout_logprobs[:2].tolist() == pytest.approx([-0.7, -0.9]) and math.isnan(out[1].rollout_logprobs[2])
    assert out[2].truncated and out[2].completion_ids.tolist() == [31, 32, 33, 34, 35]
    assert out[2].rollout_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert torch.equal(out2[0].rollout_logprobs, out[0].rollout_logprobs)

    # After an update: new files, new LoRA ids (vLLM caches adapters by id), the old files gone.
    rollout.update_weights()
    rollout.generate(requests[:2])
    _, ids_v2, lora_names_v2, _ = script.events[-1]
    assert names(script.events)[-2:] == ["wake_up", "generate"]
    assert lora_names_v2 == ["agent_aux-v2", "agent_main-v2"] and not set(ids_v2) & set(ids_v1)
    assert sorted(p.name for p in export.iterdir()) == ["agent_aux-v2", "agent_main-v2"]

    rollout.close()
    assert not root.exists()  # the exports and their (now empty) root
    rollout.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        rollout.generate(requests)


def test_without_sleep_mode_vllm_keeps_its_memory(tiny_model_dir, script):
    rollout = VLLMRollout(make_policies(tiny_model_dir), sleep=False)
    rollout.generate([GenRequest(0, "a", SamplingParams(max_new_tokens=3), key=5)])
    rollout.release()
    assert names(script.events) == ["init", "generate"] and script.events[0][1]["enable_sleep_mode"] is False
    rollout.close()


def test_exports_are_removed_when_the_rollout_is_dropped_without_close(tiny_model_dir, script):
    rollout = VLLMRollout(make_policies(tiny_model_dir))  # no root: a temp dir
    export = rollout.dir
    assert (export / "agent_main-v1" / "adapter_config.json").exists()
    del rollout
    gc.collect()
    assert not export.exists()


def test_a_killed_runs_exports_are_cleared_and_other_ranks_exports_kept(tiny_model_dir, tmp_path, script):
    root = tmp_path / "vllm_adapters"
    (root / "rank0" / "agent_aux-v7").mkdir(parents=True)  # left by a killed attempt
    (root / "rank1").mkdir()  # another rank's, still running
    rollout = VLLMRollout(make_policies(tiny_model_dir), root=root)
    assert sorted(p.name for p in (root / "rank0").iterdir()) == ["agent_aux-v1", "agent_main-v1"]
    rollout.close()
    assert not (root / "rank0").exists() and (root / "rank1").exists()


def test_stand_in_vllm_without_a_gpu_says_how_to_run(tiny_model_dir, script, monkeypatch):
    monkeypatch.setattr(vllm_rollout, "_has_cuda", lambda: False)
    with pytest.raises(UserError, match="needs a CUDA GPU.*trainer.rollout=hf"):
        VLLMRollout(make_policies(tiny_model_dir))


# ------------------------------------------------------------- the importance-ratio correction
def sample(policies, n=4, tokens=5):
    """n completions (seeded random ids of uneven lengths, every third ending with EOS) of the
    prompts "prompt 0", "prompt 0", "prompt 1", ...: siblings share a prompt, as in a rollout."""
    tok, eos = policies.tokenizers[0], policies.eos_ids[0]
    gen = torch.Generator().manual_seed(n)
    comps = []
    for j in range(n):
        ids = torch.randint(100, 1000, (tokens - j % 2,), generator=gen)
        if j % 3 == 0:
            ids[-1] = eos[0]
        comps.append(to_completion(tok, encode_prompt(tok, f"prompt {j // 2}"), ids, eos))
    return comps


def trainer_logprobs(policies, agent, comps, micro):
    """The trainer's log-probs of each completion, computed in policy_update's own micro-batches
    (the same passes, so the same bits)."""
    pad = policies.tokenizers[0].pad_token_id
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad(), policies.acting(agent) as model:
        for idx in micro_batches(comps, micro):
            logp, _, _ = completion_logprobs(model, [comps[j].prompt_ids for j in idx],
                                             [comps[j].completion_ids for j in idx], pad)
            for row, j in enumerate(idx):
                out[j] = logp[row, :len(comps[j].completion_ids)].clone()
    return [out[j] for j in range(len(comps))]


@pytest.mark.parametrize("settings", [
    UpdateSettings(aggregation="seq_sum", rollout_is_cap=2.0),  # MAGRPO's REINFORCE loss, no ratio
    UpdateSettings(aggregation="token_mean", clip_eps=0.2, epochs=2, rollout_is_cap=2.0),  # PPO-clip, 2 epochs
], ids=["reinforce", "ppo_clip"])
def test_rollout_logprobs_equal_to_the_trainers_change_nothing(tiny_model_dir, settings):
    key, agent, micro = (0, "agent_aux"), 0, 2
    plain, corrected = make_policies(tiny_model_dir), make_policies(tiny_model_dir)
    comps = sample(plain)
    advs = torch.tensor([1.0, -0.5, 0.25, -2.0])
    exact = [Completion(c.prompt_ids, c.completion_ids, c.text, c.truncated, lp)
             for c, lp in zip(comps, trainer_logprobs(corrected, agent, comps, micro))]
    want = policy_update(plain, agent, key, comps, advs, settings, micro)
    got = policy_update(corrected, agent, key, exact, advs, settings, micro)
    assert got["rollout_is/mean"] == 1.0 and got["rollout_is/clip_ratio"] == 0.0
    assert got["rollout_is/logp_abs_diff_mean"] == 0.0
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert "rollout_is/mean" not in want  # HFRollout's completions: no correction, no metrics
    for p, q in zip(plain.adapter_parameters(*key), corrected.adapter_parameters(*key)):
        assert torch.equal(p, q)


@pytest.mark.numerics
@pytest.mark.parametrize("clip_eps", [None, 0.2])
@pytest.mark.parametrize("aggregation", ["seq_sum", "token_mean"])
def test_known_offsets_weight_each_tokens_gradient_by_the_truncated_ratio(tiny_model_dir, clip_eps, aggregation):
    """The loss's gradient with respect to each token's log-prob (autograd through policy_loss)
    against its closed form -A_b * w[b, t] / norm, in float64 (the model's log-probs and the
    offsets): a few elementwise roundings apart, so to FLOAT64_REL (conftest.py) of the largest."""
    policies = make_policies(tiny_model_dir, dtype="float64")
    comps = sample(policies, n=3, tokens=6)
    pad = policies.tokenizers[0].pad_token_id
    with torch.no_grad(), policies.acting(0) as model:
        logp, mask, _ = completion_logprobs(model, [c.prompt_ids for c in comps], [c.completion_ids for c in comps], pad)
    assert logp.dtype == torch.float64
    logp = logp.requires_grad_()  # the tiny model's token log-probs, as the loss's input
    mask = mask.bool()
    # Trainer minus sampler log-prob per token, cycling over values below, at and above log(cap).
    offsets = torch.tensor([-2.0, -0.3, 0.0, 0.4, 0.9, 3.0, 50.0], dtype=torch.float64)
    diff = offsets[torch.arange(logp.numel()) % len(offsets)].reshape(logp.shape)
    rollout = logp.detach() - diff
    rollout[0, 1] = float("nan")  # a token the sampler gave no log-prob for: weight 1
    cap = 2.0
    w = torch.exp(diff).clamp(max=cap)
    w[0, 1] = 1.0
    adv = torch.tensor([1.5, -0.5, 2.0], dtype=torch.float64)
    loss, stats = policy_loss(logp, None, adv, mask, aggregation, clip_eps=clip_eps, rollout_logp=rollout,
                              rollout_is_cap=cap)
    loss.backward()
    # On-policy (old = logp): ratio 1 inside any clip, so d loss / d logp[b, t] = -A_b * w[b, t] / norm.
    norm = float(mask.sum()) if aggregation == "token_mean" else len(comps)
    want = torch.where(mask, -adv[:, None] * w / norm, torch.zeros((), dtype=torch.float64))
    assert_close_to_scale(logp.grad, want, FLOAT64_REL, "weighted gradient")
    known = mask.clone()
    known[0, 1] = False
    assert stats["rollout_is/mean"] == pytest.approx(float(w[mask].mean()))
    assert stats["rollout_is/clip_ratio"] == pytest.approx(float((diff[known] > math.log(cap)).sum() / mask.sum()))
    assert stats["rollout_is/logp_diff_mean"] == pytest.approx(float(diff[known].sum() / mask.sum()), rel=FLOAT64_REL)

    # No cap: no weighting (the gradient of the plain loss), the mismatch still reported.
    logp.grad = None
    loss, stats = policy_loss(logp, None, adv, mask, aggregation, clip_eps=clip_eps, rollout_logp=rollout)
    loss.backward()
    assert_close_to_scale(logp.grad, torch.where(mask, -adv[:, None] / norm, torch.zeros((), dtype=torch.float64)),
                          FLOAT64_REL, "plain gradient")
    assert stats["rollout_is/mean"] == 1.0 and stats["rollout_is/clip_ratio"] == 0.0
    assert stats["rollout_is/logp_diff_mean"] == pytest.approx(float(diff[known].sum() / mask.sum()), rel=FLOAT64_REL)


def test_rollout_is_cap_below_one_is_refused(tmp_path):
    base = ["model=local", "model.path=/nowhere", "logger=none", f"run_dir={tmp_path}", "task=tldr"]
    validate(compose_config([*base, "algo.rollout_is_cap=null"]))
    with pytest.raises(UserError, match=r"algo.rollout_is_cap.*set it >= 1"):
        validate(compose_config([*base, "algo.rollout_is_cap=0.5"]))


# ---------------------------------------------------------------------- through the trainer
ALGOS = {  # the algorithms whose actors train with policy_update
    "magrpo": ["algo=magrpo", "algo.num_turns=1", "algo.num_generations=2"],
    "at_grpo": ["algo=at_grpo", "algo.num_branches=2", "algo.mini_batch_size=2"],
    "collm_cc": ["algo=collm_cc", "trainer.prompts_per_step=2"],
}


def vllm_overrides(model_dir, run_dir, *extra):
    """tiny_overrides (less MAGRPO's G) on tldr, trained on the CPU with the stand-in vLLM."""
    return [o for o in tiny_overrides(model_dir, run_dir) if not o.startswith("algo.num_generations")] + [
        "task=tldr", "model.device=cpu", "trainer.rollout=vllm", *extra]


@pytest.mark.parametrize("algo", list(ALGOS))
def test_every_policy_update_gets_the_rollout_logprobs_and_the_configured_cap(tiny_model_dir, tmp_path, script, algo):
    from marl_llm.training.setup import build
    from marl_llm.training.trainer import train_step

    cfg = compose_config(vllm_overrides(tiny_model_dir, tmp_path, *ALGOS[algo], "algo.rollout_is_cap=null"))
    validate(cfg)
    run = build(cfg)
    script.events.clear()
    _, row = train_step(run, cfg, 0)
    # One rollout phase, then vLLM sleeps through the update.
    assert names(script.events)[0] == "wake_up" and names(script.events)[-1] == "sleep"
    assert names(script.events).count("sleep") == 1
    # The stand-in reports log-prob -1 for tokens the tiny random model gives about -log(49152):
    # the update saw them (a large mismatch), and no cap (the config's null, not the default 2.0,
    # which would weight these tokens by exp(-9.8)) left every weight at 1.
    assert row["rollout_is/logp_diff_mean"] < -5.0
    assert row["rollout_is/mean"] == 1.0
    run.rollout.close()


def test_training_run_removes_its_exported_adapters(tiny_model_dir, tmp_path, script):
    from marl_llm.training.trainer import train

    run_dir = tmp_path / "run"
    train(compose_config(vllm_overrides(tiny_model_dir, run_dir, *ALGOS["magrpo"], "trainer.eval_before=false")))
    assert any(e[0] == "generate" for e in script.events)
    assert not (run_dir / "vllm_adapters").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_row = next(r for r in rows if "train/reward" in r)
    # The default cap 2.0 weights the stand-in's mismatched tokens (see above) by about exp(-9.8).
    assert 0.0 < train_row["train/rollout_is/mean"] < 1e-2


def test_buffered_samples_keep_their_rollout_logprobs_through_a_checkpoint():
    from marl_llm.algos.buffer import BufferedSample, SampleBuffer

    logps = torch.tensor([-0.5, float("nan")])
    with_logps = Completion(torch.tensor([1, 2]), torch.tensor([3, 4]), "x", False, logps)
    buf = SampleBuffer(4, None, 0)
    buf.push("k", BufferedSample(0, [with_logps], torch.tensor([1.0])))
    state = buf.state_dict()
    restored = SampleBuffer(4, None, 0)
    restored.load_state_dict(state)
    got = restored.items["k"][0].completions[0]
    assert torch.equal(got.rollout_logprobs[:1], logps[:1]) and math.isnan(got.rollout_logprobs[1])
    # A checkpoint written before the field existed (4-tuples) still loads, without log-probs.
    state["items"][0][1][0]["completions"] = [c[:4] for c in state["items"][0][1][0]["completions"]]
    restored.load_state_dict(state)
    assert restored.items["k"][0].completions[0].rollout_logprobs is None


def test_several_processes_run_one_engine_each_through_the_external_launcher(tiny_model_dir, script, monkeypatch):
    """Data-parallel ranks: vLLM's external-launcher executor (each rank's engine on its own GPU,
    in its own process, seeded per rank), as TRL and verl run it; a vLLM without that executor is
    refused in one line."""
    import os

    from marl_llm.distributed import world as distributed  # the process's place (rank, size)

    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING")
    before = {name: os.environ.get(name) for name in names}
    monkeypatch.setattr(distributed, "_WORLD", distributed.World(rank=1, size=2, local_rank=1))
    for name in names:
        monkeypatch.setenv(name, "")  # recorded as it was, so what the rollout sets is undone after the test
        monkeypatch.delenv(name)
    policies = make_policies(tiny_model_dir)
    import dataclasses

    sys.modules["vllm"].EngineArgs = dataclasses.make_dataclass(  # a vLLM with the executor
        "EngineArgs", [("model", str, ""), ("logprobs_mode", str, "raw_logprobs"),
                       ("distributed_executor_backend", str, "")])
    monkeypatch.setattr(vllm_rollout, "visible_gpus", lambda: 2)  # a node's 2 GPUs, both visible to each rank
    VLLMRollout(policies, sleep=False)
    (_, init), = [e for e in script.events if e[0] == "init"]
    assert init["distributed_executor_backend"] == "external_launcher" and init["tensor_parallel_size"] == 1
    assert init["seed"] == policies.seed + 1
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("1", "1", "2")
    # One visible GPU per task (SLURM's --gpus-per-task=1): the launcher's LOCAL_RANK=1 names a GPU
    # this task cannot see; the engine's device index is 0, the GPU the rank computes on.
    monkeypatch.setattr(vllm_rollout, "visible_gpus", lambda: 1)
    os.environ["LOCAL_RANK"] = "1"
    vllm_rollout.engine_kwargs_for_world(sys.modules["vllm"], 7)
    assert os.environ["LOCAL_RANK"] == "0"

    for name, module in stand_in_vllm(Script()).items():  # its EngineArgs has no distributed_executor_backend
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(UserError, match=r"^trainer.rollout=vllm with 2 processes needs vLLM's external-launcher "
                                        r"executor .*use trainer.rollout=hf$"):
        VLLMRollout(policies, sleep=False)
    monkeypatch.setattr(distributed, "_WORLD", distributed.World())
    assert vllm_rollout.engine_kwargs_for_world(sys.modules["vllm"], 7) == {"seed": 7}  # one process: as before
    monkeypatch.undo()
    assert {name: os.environ.get(name) for name in names} == before  # nothing leaks into later tests
