"""What the console shows while a run trains, and what the run dir's job log keeps: the run's
`marl_llm` logger (in-process runs get a console handler), the progress (tqdm bars on a terminal,
periodic status lines elsewhere: `Watch`) and the line of each training step (`step_line`)."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Iterator

from marl_llm.config import UserError
from marl_llm.rollout.base import PROGRESS

# What the console shows and the run dir's job log keeps (the console script's logging is Hydra's:
# hydra/job_logging=marl_llm, configure.JOB_LOGGING).
log = logging.getLogger("marl_llm")


def format_metrics(metrics: dict[str, float], keys: tuple[str, ...]) -> str:
    return "  ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)


def _prints_to_console(logger: logging.Logger, inherited: bool = True) -> bool:
    """Does a record of `logger` reach a handler that writes to the console (the current stdout or
    stderr), one of its own or (inherited) of its parents? Pytest's capturing handlers and file
    handlers do not count."""
    console = (sys.stdout, sys.stderr)
    node: logging.Logger | None = logger
    while node is not None:
        if any(isinstance(h, logging.StreamHandler) and h.stream in console for h in node.handlers):
            return True
        node = node.parent if inherited and node.propagate else None
    return False


@contextlib.contextmanager
def console_logging() -> Iterator[None]:
    """The run's lines go through `log`. The console script's are Hydra's to print and keep
    (hydra/job_logging=marl_llm: the console and <run dir>/<job>.log); train() called in-process
    (tests, notebooks) gets a console handler of the same format for the run's duration."""
    level = log.level
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    handler = None
    if not _prints_to_console(log):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[marl-llm] %(message)s"))
        log.addHandler(handler)
    try:
        yield
    finally:
        if handler is not None:
            log.removeHandler(handler)
        log.setLevel(level)


def duration(seconds: float) -> str:
    """45s, 7m30s, 2h05m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


# The bars mode's second bar during a generate call.
GENERATING_BAR = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} sequences [{elapsed}<{remaining}{postfix}]"


class Watch(logging.Handler):
    """The console's progress (trainer.progress): the training steps with their ETA and what runs
    within a step or an evaluation. On a terminal (bars): tqdm bars on stderr, the log lines
    printed above them. Elsewhere (lines: a SLURM log, a pipe): a status line on stderr every
    trainer.progress_every_s seconds while a step or an evaluation runs, so a slow one never
    leaves the log silent. The trainer says what runs (begin, step_done, end); the work reports
    through the events of rollout.PROGRESS (debug records, their numbers in `extra`):

        phase {phase}                   a part starts: rollout, update, greedy / sampled rollout
        generate {sequences}            a generate call for that many sequences starts
        decoding {tokens}               about the tokens decoded since the last report
        generated {sequences, tokens}   a chunk of the call's sequences is done
        generate done                   the call is done: what follows in a rollout scores rewards
        micro-batch {sequences}         a forward/backward pass of an update starts
        sandbox job                     a sandboxed program finished (reward scoring)
    """

    def __init__(self, mode: str, every_s: float, max_steps: int = 0, done_steps: int = 0):
        super().__init__(logging.DEBUG)
        if mode not in ("auto", "bars", "lines", "off"):
            raise UserError(f"trainer.progress={mode} is not a choice: auto (bars on a terminal, else lines), bars, "
                            "lines (a status line every trainer.progress_every_s seconds) or off")
        if not every_s > 0:
            raise UserError(f"trainer.progress_every_s={every_s} must be > 0 (seconds between status lines), "
                            "e.g. trainer.progress_every_s=60")
        self.stream = sys.stderr
        self.mode = ("bars" if self.stream.isatty() else "lines") if mode == "auto" else mode
        self.every_s, self.max_steps, self.done_steps = every_s, max_steps, done_steps
        self.step_times: list[float] = []
        self.context: str | None = None  # what runs: "step 3/10", "eval @ step 0"; None: nothing
        self._shown: tuple | None = None  # what the bars mode's second bar shows
        self._stop = threading.Event()
        self._exit = contextlib.ExitStack()

    # -- the trainer's side
    def start(self, max_steps: int, done_steps: int) -> None:
        """Watch a run of `max_steps` steps, `done_steps` of them done (a resumed run)."""
        self.max_steps, self.done_steps = max_steps, done_steps
        PROGRESS.addHandler(self)  # also when off: the step line's tokens/s are counted here
        PROGRESS.setLevel(logging.DEBUG)
        self._exit.callback(PROGRESS.removeHandler, self)
        self._exit.callback(PROGRESS.setLevel, logging.NOTSET)
        if self.mode == "off":
            return
        if self.mode == "bars":
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            # Log lines to the console go through tqdm.write, above the bars (not through them).
            self._exit.enter_context(logging_redirect_tqdm(
                [logger for logger in (logging.getLogger(), log) if _prints_to_console(logger, inherited=False)]))
            self.steps_bar = tqdm(total=self.max_steps, initial=self.done_steps, desc="training", unit="step",
                                  file=self.stream, position=0, dynamic_ncols=True)
            self.bar = tqdm(bar_format="{desc}", file=self.stream, position=1, leave=False, dynamic_ncols=True)
            self._exit.callback(self.steps_bar.close)
            self._exit.callback(self.bar.close)
        beat = threading.Thread(target=self._beat, name="marl-llm-progress", daemon=True)
        beat.start()
        self._exit.callback(beat.join)
        self._exit.callback(self._stop.set)

    def stop(self) -> None:
        self._exit.close()

    def begin(self, context: str) -> None:
        """A training step ("step 3/10") or an evaluation ("eval @ step 0") starts."""
        with self.lock:
            self.context, self.started = context, time.monotonic()
            self.last_line = self.started
            self.phase, self.activity = "", ""
            self.requested = self.sequences = self.tokens = self.decoding = 0
            self.generate_s, self.generating_since = 0.0, None
            self.micro_batches = self.jobs = 0
            self._show()

    def end(self) -> None:
        with self.lock:
            self.context = None
            self._show()

    def step_done(self, seconds: float) -> None:
        with self.lock:
            self.step_times.append(seconds)
            self.done_steps += 1
            self.context = None
            if self.mode == "bars":
                self.steps_bar.update(1)
            self._show()

    def eta_s(self) -> float | None:
        """Seconds until the last step (the mean step time so far; evaluations not counted)."""
        if not self.step_times:
            return None
        return (self.max_steps - self.done_steps) * sum(self.step_times) / len(self.step_times)

    def tokens_per_s(self) -> float | None:
        """Generated tokens per second of generation in what ran last (None: nothing generated)."""
        seconds = self.generate_s + (time.monotonic() - self.generating_since if self.generating_since else 0.0)
        tokens = self.tokens + self.decoding
        return tokens / seconds if tokens and seconds > 0 else None

    # -- the work's side (rollout.PROGRESS)
    def emit(self, record: logging.LogRecord) -> None:
        if self.context is None:
            return
        event, x = record.getMessage(), record.__dict__
        now = time.monotonic()
        if event == "phase":
            self.phase, self.activity = x["phase"], ""
        elif event == "generate":
            self.activity, self.requested, self.sequences = "generating", x["sequences"], 0
            self.generating_since = now
        elif event == "decoding":
            self.decoding += x["tokens"]
        elif event == "generated":
            self.sequences += x["sequences"]
            self.tokens += x["tokens"]
            self.decoding = 0  # the chunk's exact count replaces the estimate
        elif event == "generate done" and self.generating_since is not None:
            self.generate_s += now - self.generating_since
            self.generating_since, self.activity = None, "scoring rewards"
        elif event == "micro-batch":
            self.activity = "update"
            self.micro_batches += 1
        elif event == "sandbox job":
            self.jobs += 1
        self._show()

    # -- what the console shows
    def _what(self) -> str:
        """What runs now, in words: "step 3/10, rollout: generating 24/32 sequences, ..."."""
        what = f"{self.context}, {self.phase}" if self.phase else self.context
        if self.activity == "generating":
            rate = self.tokens_per_s()
            what += (f": generating {self.sequences}/{self.requested} sequences, {self.tokens + self.decoding} tokens"
                     + (f" at {rate:.1f} tokens/s" if rate else ""))
        elif self.activity == "scoring rewards":
            what += ": scoring rewards" + (f", sandbox jobs done: {self.jobs}" if self.jobs else "")
        elif self.activity == "update":
            what += f": micro-batches: {self.micro_batches}"
        return what

    def status(self) -> str:
        """The lines mode's status line: what runs, for how long, and the training's ETA."""
        eta = self.eta_s() if self.context.startswith("step") else None
        return (f"{self._what()} ({duration(time.monotonic() - self.started)} in"
                + (f"; ETA {duration(eta)})" if eta is not None else ")"))

    def _show(self) -> None:
        """The bars mode's second bar: the sequences of a generate call as a bar (with tokens and
        tokens/s), anything else as its words and clock."""
        if self.mode != "bars":
            return
        bar, generating = self.bar, self.activity == "generating"
        if generating:
            rate = self.tokens_per_s()
            bar.set_description_str(f"{self.context}, {self.phase}: generating", refresh=False)
            bar.set_postfix_str(f"{self.tokens + self.decoding} tokens" + (f", {rate:.1f} tokens/s" if rate else ""),
                                refresh=False)
        else:
            bar.set_description_str(self._what() if self.context else "", refresh=False)
            bar.set_postfix_str("", refresh=False)
        shown = (self.context, self.phase, self.activity, self.requested if generating else None)
        if shown != self._shown:  # something else runs: its own count and clock
            self._shown = shown
            bar.bar_format = GENERATING_BAR if generating else "{desc}" + (" [{elapsed}]" if self.context else "")
            bar.total, bar.unit = (self.requested, "seq") if generating else (None, "it")
            bar.reset()
        bar.n = self.sequences if generating else 0
        bar.refresh()

    def _beat(self) -> None:
        """Every second: the bars' clocks move; a status line when one is due (lines)."""
        while not self._stop.wait(min(1.0, self.every_s)):
            with self.lock:
                if self.context is None:
                    continue
                if self.mode == "bars":
                    self._show()
                elif time.monotonic() - self.last_line >= self.every_s:
                    print(f"[marl-llm] {self.status()}", file=self.stream, flush=True)
                    self.last_line = time.monotonic()


def step_line(step: int, max_steps: int, metrics: dict[str, float], agents: list[str],
              tokens_per_s: float | None, eta_s: float | None) -> str:
    """The console's line of a training step (docs/logging.md). No `loss`: on an
    on-policy step the ratio is 1 in value, so the loss's value is only minus the length-weighted
    mean advantage (0 for a group's zero-sum advantages over completions of one length); its
    gradient is what moves the policies, so grad_norm stands for it."""
    # reward: the team's, under every algorithm; <agent>/reward_mixed: AT-GRPO's candidate scores.
    keys = ("reward", *(f"{a}/reward_mixed" for a in agents), "reward_std", "frac_reward_zero_std",
            "frac_reward_mixed_zero_std", "pass@1", "success_rate", "grad_norm", "entropy", "completions/mean_length")
    line = f"step {step}/{max_steps}: {format_metrics(metrics, keys)}"
    if tokens_per_s:
        line += f"  tokens/s={tokens_per_s:.4g}"
    line += f"  step_time={metrics['step_time']:.4g}"
    return line + (f"  eta={duration(eta_s)}" if eta_s is not None and step < max_steps else "")
