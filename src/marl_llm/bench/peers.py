"""The peers, driven through their own PyPI packages on marl-llm's workload.

- `ComlrlMAGRPO`: comlrl's `MAGRPOTrainer` (multi-agent GRPO, one full model copy per agent,
  full-parameter AdamW per agent).
- `TrlGRPO`: trl's `GRPOTrainer` (single-agent GRPO with a LoRA adapter).
- `ComlrlMAAC` / `ComlrlIAC`: comlrl's actor-critic trainers (the same package as the MAGRPO
  peer): one shared critic over the joint prompt (MAAC, vs marl-llm's CoLLM-CC) or one critic per
  agent (IAC, vs CoLLM-DC); full model copies for every actor and critic.

Both see marl-llm's own prompts (`task.initial_prompts`) and joint reward (`task.joint_rewards`),
so the only difference measured is the training code. Each `step()` runs exactly one update of the
peer's own loop on problem `k % len(problems)` and counts the tokens the peer actually generated.
Only public (or documented-as-overridable) entry points are used; nothing is copied from the peers.
"""

from __future__ import annotations

import queue
import tempfile
import threading
import time
from typing import Any

import torch

from marl_llm.bench.workload import BenchSystem, StepStats, Workload, load_model, load_tokenizer

DEFAULT_LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}


def time_generation(system: BenchSystem, trainer: Any, method: str, count_tokens: Any = None) -> None:
    """Wrap `trainer.<method>` (the peer's generation entry point) so every call adds its wall
    time to `system._rollout_seconds` and, if given, `count_tokens(result)` to `system._tokens`."""
    generate = getattr(trainer, method)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        system._rollout_seconds += time.perf_counter() - start
        if count_tokens is not None:
            system._tokens += count_tokens(out)
        return out

    setattr(trainer, method, timed)


class _ComlrlPeer(BenchSystem):
    """What every comlrl trainer is fed: a dataset of problem indices, per-agent formatters that
    write marl-llm's prompts, and marl-llm's joint reward."""

    def _dataset(self):
        from datasets import Dataset

        # Dataset items only name the problem: the per-agent formatters write marl-llm's prompts.
        return Dataset.from_list([{"problem_index": k} for k in range(len(self.problems))])

    def _formatter(self, agent_index: int):
        def prompt_of(item: dict[str, Any]) -> str:
            return self.task.initial_prompts(self.problems[item["problem_index"]])[agent_index]

        return prompt_of

    def _joint_reward(self, *agent_completions: list[str], batch_items: list[dict[str, Any]]) -> list[float]:
        """comlrl's reward hook: one list of completions per agent. In joint_mode "aligned" it calls
        this once per joint action j with [[c_0j], [c_1j], ...]; pairing by index covers both."""
        problem = self.problems[batch_items[0]["problem_index"]]
        joint_actions = [list(action) for action in zip(*agent_completions)]
        rewards = self.task.joint_rewards([problem] * len(joint_actions), joint_actions)
        return [r.total for r in rewards]


class ComlrlMAGRPO(_ComlrlPeer):
    """comlrl's MAGRPOTrainer: one step = its `_train_step_returns(batch_item)`, the per-item call
    of its own `train()` loop. With rollout_buffer_size=1 the per-agent update runs inside it."""

    name = "comlrl_magrpo"

    def __init__(self, workload: Workload):
        super().__init__(workload)
        from comlrl.trainers.reinforce.magrpo import MAGRPOConfig, MAGRPOTrainer

        w = workload
        tokenizer = load_tokenizer(w)
        # comlrl keeps one full model per agent; load them ourselves so w.dtype applies.
        agents = [load_model(w) for _ in range(w.agents)]
        args = MAGRPOConfig(
            num_turns=1, rollout_buffer_size=1, eval_interval=0, num_agents=w.agents,
            num_generations=w.num_generations, max_new_tokens=w.new_tokens,
            temperature=w.temperature, top_p=w.top_p,
            top_k=0,  # None: comlrl omits it and generate() fills in HF's default 50; 0 turns top-k off
            agent_learning_rate=w.learning_rate,
        )
        # Plain text, not chat-templated: comlrl cuts prompt from completion at the first pad
        # token, and with pad == eos a chat template's end-of-turn token would cut it early.
        self.trainer = MAGRPOTrainer(
            agents=agents, num_agents=w.agents, tokenizer=tokenizer, train_dataset=self._dataset(),
            formatters=[self._formatter(i) for i in range(w.agents)],
            reward_func=self._joint_reward, args=args,
        )
        for agent in self.trainer.agents:  # as its train() does before the epoch loop
            agent.train()
        self._tokens, self._rollout_seconds = 0, 0.0
        # comlrl routes every rollout through `_generate_completions`, whose result carries each
        # completion's length (`response_lens`).
        time_generation(self, self.trainer, "_generate_completions",
                        lambda out: sum(int(n) for n in out["response_lens"]))
        self._step_index = 0

    def step(self) -> StepStats:
        w = self.workload
        item = self.trainer.train_dataset[self._step_index % len(self.problems)]
        self._step_index += 1
        self._tokens, self._rollout_seconds = 0, 0.0
        start = time.perf_counter()
        # kwargs flow into generate(): min = max new tokens fixes every completion's length.
        self.trainer._train_step_returns(item, min_new_tokens=w.new_tokens)
        seconds = time.perf_counter() - start
        if any(self.trainer.rollout_buffers):
            raise RuntimeError("comlrl buffered the step's samples instead of updating (rollout_buffer_size != 1?)")
        return StepStats(seconds=seconds, tokens=self._tokens, rollout_seconds=self._rollout_seconds)


class ComlrlMAAC(_ComlrlPeer):
    """comlrl's MAACTrainer (one critic over the joint prompt: the peer of marl-llm's CoLLM-CC).

    One step = its `_run_batch` (the body of its own `train()` loop) over `prompts_per_step`
    dataset items, one trajectory (G = 1) each, with rollout_buffer_size = train_batch_size = the
    step's samples per agent: the buffers drain once per step, one actor step per agent and one
    critic step per agent's batch (the shared critic: once per agent), as comlrl trains."""

    name = "comlrl_maac"

    def __init__(self, workload: Workload):
        super().__init__(workload)
        from comlrl.trainers.actor_critic.maac import MAACConfig, MAACTrainer

        self._build(MAACConfig, MAACTrainer, critics=1, early_termination_threshold=None)

    def _build(self, config_cls, trainer_cls, critics: int, **options: Any) -> None:
        w = self.workload
        if w.num_generations != 1:
            raise ValueError(f"{self.name}: one trajectory per environment: set num_generations=1 "
                             f"(got {w.num_generations}) and prompts_per_step for more")
        n = w.joint_actions_per_step
        args = config_cls(
            num_train_epochs=1, num_turns=1, num_agents=w.agents, num_generations=1,
            rollout_buffer_size=n, train_batch_size=n, eval_interval=0,
            max_new_tokens=w.new_tokens, temperature=w.temperature, top_p=w.top_p,
            top_k=0,  # None: comlrl omits it and generate() fills in HF's default 50; 0 turns top-k off
            agent_learning_rate=w.learning_rate, **options,
        )
        # comlrl keeps full models: one per actor and per critic, loaded here so w.dtype applies.
        self.trainer = trainer_cls(
            agents=[load_model(w) for _ in range(w.agents)], critics=[load_model(w) for _ in range(critics)],
            tokenizer=load_tokenizer(w), train_dataset=self._dataset(),
            formatters=[self._formatter(i) for i in range(w.agents)], reward_func=self._joint_reward, args=args,
        )
        self._tokens, self._rollout_seconds = 0, 0.0
        for agent in self.trainer.agents:  # every rollout goes through the actor's generate()
            self._time_generate(agent)
        self._step_index = 0

    def _time_generate(self, agent: Any) -> None:
        """Wrap the actor's `generate` (comlrl's CausalLMWithValueHead proxy): min = max new tokens
        fixes every completion's length (comlrl's trainers pass no generation kwargs through), and
        every call adds its wall time and new tokens to the step's rollout counters."""
        generate, fixed = agent.generate, self.workload.new_tokens

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = generate(*args, **{**kwargs, "min_new_tokens": fixed})
            self._rollout_seconds += time.perf_counter() - start
            self._tokens += out.shape[0] * (out.shape[1] - kwargs["input_ids"].shape[1])
            return out

        agent.generate = timed

    def step(self) -> StepStats:
        from collections import defaultdict

        items = [self.trainer.train_dataset[j] for j in self.step_problems(self._step_index)]
        self._step_index += 1
        self._tokens, self._rollout_seconds = 0, 0.0
        start = time.perf_counter()
        self.trainer._run_batch(items, defaultdict(list))
        seconds = time.perf_counter() - start
        if any(self.trainer.rollout_buffers):
            raise RuntimeError(f"{self.name} kept samples in its buffers instead of updating "
                               "(rollout_buffer_size != samples per step?)")
        return StepStats(seconds=seconds, tokens=self._tokens, rollout_seconds=self._rollout_seconds)


class ComlrlIAC(ComlrlMAAC):
    """comlrl's IACTrainer with separate per-agent critics (use_separate_critic, its default: the
    peer of marl-llm's CoLLM-DC); otherwise as ComlrlMAAC, each critic stepping once per step."""

    name = "comlrl_iac"

    def __init__(self, workload: Workload):
        _ComlrlPeer.__init__(self, workload)
        from comlrl.trainers.actor_critic.iac import IACConfig, IACTrainer

        self._build(IACConfig, IACTrainer, critics=workload.agents, use_separate_critic=True,
                    early_termination_threshold=None)


class _TrainingStopped(Exception):
    """Raised in the trainer thread to leave trl's loop without running another step."""


class TrlGRPO(BenchSystem):
    """trl's GRPOTrainer, single agent with LoRA. trl owns its loop, so `trainer.train()` runs in a
    daemon thread that a callback parks at every `on_step_begin`; `step()` lets exactly one
    optimizer step through and times it from release to `on_step_end`. Generation happens inside
    (GRPO generates in `_prepare_inputs`, called from `training_step`)."""

    name = "trl_grpo"
    setup_timeout_s = 1800.0

    def __init__(self, workload: Workload):
        super().__init__(workload)
        from datasets import Dataset
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer

        w = workload
        if w.agents != 1:
            raise ValueError(f"trl_grpo is single-agent: set agents=1 (got {w.agents})")
        # extra["step_timeout_s"]: how long step() waits for trl's thread before giving up.
        self.step_timeout_s = float(w.extra.get("step_timeout_s", 3600))
        lora = {**DEFAULT_LORA, **(w.lora or {})}
        self._output_dir = tempfile.TemporaryDirectory(prefix="trl_grpo_")
        args = GRPOConfig(
            output_dir=self._output_dir.name, seed=w.seed, use_cpu=True, report_to=[],
            save_strategy="no", logging_steps=10**9, disable_tqdm=True, max_steps=10**9,
            # One prompt x G completions per optimizer step, generated once and used once.
            num_generations=w.num_generations, per_device_train_batch_size=w.num_generations,
            gradient_accumulation_steps=1, num_iterations=1, shuffle_dataset=False,
            max_completion_length=w.new_tokens, generation_kwargs={"min_new_tokens": w.new_tokens},
            temperature=w.temperature, top_p=w.top_p, top_k=0,
            learning_rate=w.learning_rate, lr_scheduler_type="constant", weight_decay=0.0,
            beta=0.0,  # no KL term and no reference model, as marl-llm runs
            # trl's defaults differ from marl-llm's setting: it turns on bf16 autocast and
            # activation (gradient) checkpointing; keep the model in w.dtype and the plain backward.
            # (transformers 5 renamed gradient_checkpointing; the new name wins over trl's default.)
            bf16=False, fp16=False, activation_checkpointing=False, use_vllm=False,
        )
        peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=list(lora["target_modules"]),
                                 lora_dropout=lora.get("dropout", 0.0), task_type="CAUSAL_LM")
        # Chat-message prompts (trl applies the chat template); problem_index reaches the reward as a kwarg.
        dataset = Dataset.from_list([
            {"prompt": [{"role": "user", "content": self.task.initial_prompts(p)[0]}], "problem_index": k}
            for k, p in enumerate(self.problems)
        ])
        self._go: queue.Queue[str] = queue.Queue()
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.trainer = GRPOTrainer(
            model=load_model(w), reward_funcs=self._joint_reward, args=args, train_dataset=dataset,
            processing_class=load_tokenizer(w), peft_config=peft_config, callbacks=[self._gate_callback()],
        )
        time_generation(self, self.trainer, "_generate_single_turn")  # tokens: counted in the reward hook
        self._tokens, self._rollout_seconds, self._problems_seen = 0, 0.0, []
        self._step_index = 0
        self._thread = threading.Thread(target=self._train, name="trl-grpo-train", daemon=True)
        self._thread.start()
        self._wait_for("parked", self.setup_timeout_s)  # trainer setup is not part of any step

    # -- what runs inside trl ---------------------------------------------------------------
    def _joint_reward(self, prompts, completions, completion_ids, problem_index, **kwargs) -> list[float]:
        """trl's reward hook: one chat completion per row; dataset columns arrive as kwargs."""
        self._tokens += sum(len(ids) for ids in completion_ids)
        self._problems_seen.extend(problem_index)
        problems = [self.problems[k] for k in problem_index]
        joint_actions = [[c[0]["content"]] for c in completions]
        return [r.total for r in self.task.joint_rewards(problems, joint_actions)]

    def _gate_callback(self):
        from transformers import TrainerCallback

        system = self

        class StepGate(TrainerCallback):
            """Parks trl's loop before each optimizer step until `step()` lets it through."""

            def on_step_begin(self, args, state, control, **kwargs):
                system._events.put(("parked", None))
                if system._go.get() == "stop":
                    raise _TrainingStopped()

            def on_step_end(self, args, state, control, **kwargs):
                system._events.put(("step_end", time.perf_counter()))

        return StepGate()

    def _train(self) -> None:
        # OpenMP thread counts are per OS thread: repeat the setting in the thread that trains.
        if self.workload.threads > 0:
            torch.set_num_threads(self.workload.threads)
        try:
            self.trainer.train()
            self._events.put(("error", RuntimeError("trl's train() returned: max_steps reached")))
        except _TrainingStopped:
            self._events.put(("stopped", None))
        except BaseException as error:  # noqa: BLE001 - handed to step(), which raises it
            self._events.put(("error", error))

    def _wait_for(self, kind: str, timeout_s: float) -> Any:
        try:
            event, value = self._events.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"trl's training thread sent no '{kind}' within {timeout_s:.0f} s") from None
        if event == "error":
            raise RuntimeError("trl's training thread failed") from value
        if event != kind:
            raise RuntimeError(f"trl's training thread sent '{event}', expected '{kind}'")
        return value

    # -- the benchmark interface ------------------------------------------------------------
    def step(self) -> StepStats:
        if not self._thread.is_alive():
            raise RuntimeError("trl's training thread is no longer running")
        expected_problem = self._step_index % len(self.problems)
        self._step_index += 1
        self._tokens, self._rollout_seconds, self._problems_seen = 0, 0.0, []
        global_step = self.trainer.state.global_step
        start = time.perf_counter()
        self._go.put("step")
        end = self._wait_for("step_end", self.step_timeout_s)
        # Let trl finish its bookkeeping (logging, next batch) before returning, untimed, so it
        # does not overlap whatever runs next.
        self._wait_for("parked", self.step_timeout_s)
        if self.trainer.state.global_step != global_step + 1:
            raise RuntimeError(f"one step() ran {self.trainer.state.global_step - global_step} optimizer steps")
        if set(self._problems_seen) != {expected_problem}:
            raise RuntimeError(f"step used problems {sorted(set(self._problems_seen))}, expected {expected_problem}")
        return StepStats(seconds=end - start, tokens=self._tokens, rollout_seconds=self._rollout_seconds)

    def close(self) -> None:
        """Stop trl's loop at its next step boundary (the thread is a daemon otherwise)."""
        if self._thread.is_alive():
            self._go.put("stop")
            self._thread.join(timeout=60)
        self._output_dir.cleanup()
