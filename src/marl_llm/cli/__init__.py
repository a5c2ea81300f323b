"""The console scripts: `marl-llm` (train.py) and `marl-llm-eval` (eval.py)."""

import os as _os
import sys as _sys


def _interrupted_while_importing(kind, value, traceback):  # noqa: ANN001  (sys.excepthook's signature)
    """Ctrl-C while the console script is still importing (torch, Hydra: seconds): one line and
    the shell's 130, not a traceback from deep inside an import."""
    if issubclass(kind, KeyboardInterrupt):
        print("interrupted while starting: nothing was run", file=_sys.stderr, flush=True)
        _os._exit(130)
    _previous_hook(kind, value, traceback)


# Only when this process is one of the console scripts: a library user's own Ctrl-C handling stays.
_previous_hook = _sys.excepthook
if _os.path.basename(_sys.argv[0] if _sys.argv else "").startswith("marl-llm"):
    _sys.excepthook = _interrupted_while_importing
