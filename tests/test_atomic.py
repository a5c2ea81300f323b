"""Atomic writes: all or nothing, no temp files left behind, ordinary file permissions."""

from __future__ import annotations

import os

import pytest

from marl_llm.runs.atomic import atomic_write, atomic_write_text


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "summary.json"
    atomic_write_text(path, "old")

    def crash(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(path, crash)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_permissions_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.md", "x")
        os.umask(0o077)
        atomic_write_text(tmp_path / "b.md", "y")
    finally:
        os.umask(old)
    assert (tmp_path / "a.md").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.md").stat().st_mode & 0o777 == 0o600
