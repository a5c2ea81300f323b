"""A number-guessing game with feedback, written only for the tests of task=env (tests/test_env_task.py).

Two agents guess a secret number from 1 to `high` each turn and are told whether their guesses were
too low or too high. The team scores when either guess is right (the episode then ends), plus how
close the better guess came; each agent's own reward is how close its own guess came (+ `role_bonus`
for the guesser, so a test can tell the role rewards apart). `GUESS_LOG` (an env var) names a file
that gets one JSON line per step: the seed, the environment's own turn counter, the agents and
whether it was the dry run's (placeholder actions: marl-llm tries the environment when it builds
the task).

`mode` breaks the contract on purpose: reset_one_observation | step_text_reward | step_three_values |
step_raises |
reset_exits | step_exits (sys.exit(0), which once ended the run with exit code 0 and no line) |
huge_reset | huge_step (a 20 MiB observation, which once decoded for minutes) | long_step (a
3,000-word observation: within task.max_observation_chars, cut to task.max_observation_tokens).
A step mode prefixed `late_` (late_step_raises) breaks only on a model's text: the dry run that
builds the task, with its placeholder actions, passes, and the error comes during training.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys

from marl_llm.tasks.env import DRY_RUN_ACTION

HUGE = 20 * 2**20  # characters


class Guess:
    agents = ["guesser", "helper"]

    def __init__(self, high: int = 20, role_bonus: float = 0.0, mode: str = ""):
        self.high, self.role_bonus, self.mode = high, role_bonus, mode

    def reset(self, seed):
        self.seed, self.turn = seed, 0
        self.secret = random.Random(seed).randint(1, self.high)
        if self.mode == "reset_exits":
            sys.exit(0)
        if self.mode == "huge_reset":
            return {a: "x" * HUGE for a in self.agents}
        if self.mode == "reset_one_observation":
            return [self._ask("")]
        return {a: self._ask("") for a in self.agents}

    def _ask(self, feedback: str) -> str:
        return f"I think of a number from 1 to {self.high}.{feedback} Answer with one number."

    def _guess(self, text: str) -> int | None:
        m = re.search(r"\d+", text)
        return int(m.group()) if m else None

    def _closeness(self, guess: int | None) -> float:
        return 0.0 if guess is None else max(0.0, 1.0 - abs(guess - self.secret) / self.high)

    def step(self, actions):
        self.turn += 1
        dry = DRY_RUN_ACTION in actions.values()
        mode = "" if self.mode.startswith("late_") and dry else self.mode.removeprefix("late_")
        if mode == "step_raises":
            raise ValueError("the referee is out to lunch")
        if mode == "step_exits":
            sys.exit(0)
        if log := os.environ.get("GUESS_LOG"):
            with open(log, "a") as f:
                record = {"seed": self.seed, "turn": self.turn, "agents": sorted(actions), "dry": dry}
                f.write(json.dumps(record) + "\n")
        guesses = {a: self._guess(actions[a]) for a in self.agents}
        found = any(g == self.secret for g in guesses.values())
        closeness = {a: self._closeness(g) for a, g in guesses.items()}
        team = {"found": float(found), "close": max(closeness.values())}
        rewards = {a: closeness[a] + (self.role_bonus if a == "guesser" else 0.0) for a in self.agents}
        if mode == "step_text_reward":
            rewards["helper"] = "high"

        def said(g):
            return "nothing" if g is None else f"{g}, {'right' if g == self.secret else 'too low' if g < self.secret else 'too high'}"
        feedback = " Last turn: " + "; ".join(f"{a} said {said(g)}" for a, g in guesses.items()) + "."
        observations = {a: self._ask(feedback) for a in self.agents}
        if mode == "huge_step":
            observations["helper"] = "y" * HUGE
        if mode == "long_step":
            observations["helper"] = "word " * 3000
        if mode == "step_three_values":
            return observations, rewards, team
        return observations, rewards, team, found, {"success": found}


class Unnamed(Guess):
    """The game without agent names (task.agents must name them)."""

    agents: list[str] = []
