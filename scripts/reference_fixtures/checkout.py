"""What the fixture scripts share about the reference checkout they read."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit(checkout: Path) -> str | None:
    """The checkout's commit, or None when it is not a git work tree (pass --commit then)."""
    try:
        return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
