"""bench.json (everything measured), bench.md (the tables) and bench_scaling.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from marl_llm.runs.atomic import atomic_write_text

LABELS = {"marl_magrpo": "marl-llm MAGRPO", "comlrl_magrpo": "comlrl MAGRPOTrainer",
          "bare_generate": "ceiling: bare generate + fwd/bwd", "marl_grpo": "marl-llm GRPO (algo=single)",
          "trl_grpo": "trl GRPOTrainer", "marl_collm_cc": "marl-llm CoLLM-CC", "comlrl_maac": "comlrl MAACTrainer",
          "marl_collm_dc": "marl-llm CoLLM-DC", "comlrl_iac": "comlrl IACTrainer"}
# What differs between a group's systems beyond the shared workload (printed under its table).
NOTES = {
    "collm_cc": "Both at comlrl's granularity: per agent one actor step on its samples of the step, then one step "
                "of the shared critic on the same samples (so once per agent). marl-llm: LoRA actors and a LoRA critic "
                "adapter on one shared frozen base, V(h) over the chat-templated joint prompt; comlrl: 3 full "
                "models (2 actors, 1 critic), all weights trained, its joint prompt as plain text.",
    "collm_dc": "Both at comlrl's granularity: per agent one actor step and one step of its own critic on its "
                "samples of the step. marl-llm: LoRA actors and one LoRA critic adapter per agent on one shared frozen base; "
                "comlrl: 4 full models (2 actors, 2 separate critics), all weights trained.",
}
LEVERS = {"hf_generate_peft_mixed": "transformers generate, peft mixed-adapter batches (before)",
          "own_decode_peft_mixed": "own decode loop (shared prefill, inference mode), peft mixed batches",
          "own_decode_mixed_lora": "+ MixedLoRA (stacked adapters, row mask)",
          "own_decode_all": "+ preallocated KV cache (marl-llm now)",
          "own_decode_static": "fixed-shape step instead: StaticCache, no compaction (trainer.decode=static)",
          "bare_generate_no_lora": "bare base model generate, no adapters (ceiling)"}
AXES = {"num_generations": "G (joint actions per prompt)", "agents": "agents", "new_tokens": "new tokens"}


def _num(v: Any, fmt: str = ".2f") -> str:
    return "n/a" if v is None else format(v, fmt)


def system_table(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| system | median s/step | steps (s) | tokens/step | tokens/s | rollout s | rollout tokens/s | peak RSS GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {LABELS.get(name, name)} | not run: {r['error'].splitlines()[0]} | | | | | | |")
            continue
        lines.append(f"| {LABELS.get(name, name)} | {_num(r['median_step_s'])} | {', '.join(f'{s:.1f}' for s in r['step_s'])} "
                     f"| {r['tokens_per_step']:.0f} | {_num(r['tokens_per_s'], '.1f')} | {_num(r['median_rollout_s'])} "
                     f"| {_num(r['rollout_tokens_per_s'], '.1f')} | {_num(r['peak_rss_gib'])} |")
    return lines


def write_report(report: dict[str, Any], out: Path) -> None:
    atomic_write_text(out / "bench.json", json.dumps(report, indent=2))
    m = report["machine"]
    lines = ["# marl-llm benchmark", "",
             f"Command: `{report['command']}` ({report['date']}, {report['wall_s'] / 60:.1f} min)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, torch threads {m['torch_threads']}, "
             f"CUDA: {m['cuda'] or 'none'}; Python {m['python']}, "
             + ", ".join(f"{k} {v or 'not installed'}" for k, v in m["versions"].items()), "",
             "Each group's systems ran in turn (A B C A B C ...) after a warm-up, each in its own process "
             "(peak RSS is that process's own). Every completion is exactly the workload's new tokens long "
             "(min = max new tokens) in every system. Same prompts (marl-llm's TLDR sample, one post per step; "
             "the CoLLM groups: the next posts in order, one trajectory each), "
             "same joint reward, same sampling (temperature, top-p).", ""]
    for group, results in report["groups"].items():
        w = next((r["workload"] for r in results.values() if "workload" in r), {})
        per_step = w.get("prompts_per_step", 1)
        lines += [f"## {group}: {w.get('agents')} agent(s), G={w.get('num_generations')}"
                  + (f", {per_step} posts per step (one trajectory each)" if per_step > 1 else "")
                  + f", {w.get('new_tokens')} new tokens, "
                  f"{w.get('dtype')}" + (f", LoRA {w['lora']}" if w.get("lora") else ", LoRA: marl-llm's defaults"), ""]
        lines += system_table(results) + [""]
        if group in NOTES:
            lines += [NOTES[group], ""]
    r = report["ratios"]
    lines += ["## Ratios (same run)", "", "| ratio | value | target |", "|---|---|---|",
              f"| marl-llm MAGRPO step time / comlrl | {_num(r['magrpo_step_time_vs_comlrl'], '.3f')} | <= 0.333 |",
              f"| marl-llm MAGRPO peak RSS / comlrl | {_num(r['magrpo_peak_rss_vs_comlrl'], '.3f')} | <= 0.333 |",
              f"| marl-llm GRPO step time / trl | {_num(r['grpo_step_time_vs_trl'], '.3f')} | <= 0.667 |",
              f"| marl-llm GRPO peak RSS / trl | {_num(r['grpo_peak_rss_vs_trl'], '.3f')} | |",
              f"| marl-llm rollout tokens/s / bare generate tokens/s | {_num(r['rollout_throughput_vs_bare_generate'], '.3f')} | >= 0.9 |",
              f"| marl-llm step time / ceiling (bare generate + fwd/bwd) | {_num(r['step_time_vs_ceiling'], '.3f')} | |"]
    for group, peer, label in (("collm_cc", "comlrl_maac", "CoLLM-CC"), ("collm_dc", "comlrl_iac", "CoLLM-DC")):
        if f"{group}_step_time_vs_{peer}" not in r:  # a report from before the CoLLM groups
            continue
        lines += [f"| marl-llm {label} step time / {LABELS[peer]} | {_num(r[f'{group}_step_time_vs_{peer}'], '.3f')} | |",
                  f"| marl-llm {label} peak RSS / {LABELS[peer]} | {_num(r[f'{group}_peak_rss_vs_{peer}'], '.3f')} | |",
                  f"| marl-llm {label} / MAGRPO, seconds per joint action (comlrl's granularity) | "
                  f"{_num(r[f'{group}_per_joint_action_vs_magrpo'], '.3f')} | |"]
    lines.append("")
    if report.get("levers"):
        lv = report["levers"]
        ref = lv["hf_generate_peft_mixed"]["median_s"]
        lines += ["## Rollout levers, one at a time (the magrpo group's generation, alternated, median)", "",
                  "| variant | median s | tokens/s | speed-up over the old rollout |", "|---|---|---|---|"]
        for name, r in lv.items():
            lines.append(f"| {LEVERS.get(name, name)} | {r['median_s']:.2f} | {r['tokens_per_s']:.1f} | {ref / r['median_s']:.2f}x |")
        lines.append("")
    if report.get("scaling"):
        lines += ["## Scaling (marl-llm MAGRPO; each axis doubles from the base workload)", "",
                  "| axis | value | median s/step | rollout s | tokens/s | peak RSS GiB |", "|---|---|---|---|---|---|"]
        for pnt in report["scaling"]:
            if "error" in pnt:
                lines.append(f"| {pnt['axis']} | {pnt['value']} | not run: {pnt['error'].splitlines()[0]} | | | |")
                continue
            lines.append(f"| {pnt['axis']} | {pnt['value']} | {_num(pnt['median_step_s'])} | {_num(pnt['median_rollout_s'])} "
                         f"| {_num(pnt['tokens_per_s'], '.1f')} | {_num(pnt['peak_rss_gib'])} |")
        lines += ["", "![scaling](bench_scaling.png)", ""]
        plot_scaling(report["scaling"], out / "bench_scaling.png")
    if report.get("profile"):
        lines += [f"Profile of marl-llm's step: [{report['profile']}]({report['profile']})", ""]
    elif report.get("profile_error"):
        lines += [f"Profile: not run ({report['profile_error']})", ""]
    atomic_write_text(out / "bench.md", "\n".join(lines))


def plot_scaling(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(AXES), figsize=(4.2 * len(AXES), 3.6))
    for ax, (axis, label) in zip(axes, AXES.items()):
        pts = [p for p in points if p["axis"] == axis and "error" not in p]
        if not pts:
            continue
        xs = [p["value"] for p in pts]
        ax.plot(xs, [p["median_step_s"] for p in pts], "o-", color="C0", label="s/step")
        ax.plot(xs, [pts[0]["median_step_s"] * x / xs[0] for x in xs], ":", color="C0", alpha=0.6, label="linear from first")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(label)
        ax.set_ylabel("median seconds per step", color="C0")
        twin = ax.twinx()
        twin.plot(xs, [p["peak_rss_gib"] for p in pts], "s--", color="C1", label="peak RSS")
        twin.set_ylabel("peak RSS (GiB)", color="C1")
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle("marl-llm MAGRPO step time and memory as one setting doubles")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
