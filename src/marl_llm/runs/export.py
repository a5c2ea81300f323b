"""The trained agents in the formats their users load: `<run_dir>/agents/`.

    agents/
      agents.json     the team in order: each agent's directory and base model, the step, the run
      aux/            LoRA: a peft adapter (adapter_config.json naming the base model,
                      adapter_model.safetensors), the tokenizer, README.md
      main/           algo.lora=null (full fine-tuning): a whole transformers model + tokenizer

One directory per trained policy: per agent (`algo.adapters=per_agent`, named after the agent),
one `shared/` for a shared adapter, one per `algo.policy_map` name; agents.json says which agent
acts with which. The adapters are the tensors the checkpoint holds (fp32 as trained), written
through peft's own `save_pretrained`, so `PeftModel.from_pretrained` and vLLM's LoRA loader read
them. The tensors come from `AgentPolicies.adapter_state()` (copies on the CPU, no collective),
so a rank of an FSDP run exports while the others wait.

Written into a temp sibling first and renamed into place: a reader (or a kill) finds the previous
export or the new one, never half of one (a kill between the two renames leaves the previous one
as `.agents.old-*`; the next export clears such leftovers).

With trainer.history_every, the same export is also kept along the way, as Hugging Face's
`checkpoint-N` dirs: `<run_dir>/checkpoints/checkpoint-<step>/` (agents.json and the policy dirs),
the trainer.history_keep newest (`export_history`); `marl-llm-eval <run_dir> --step N` evaluates one.
The tokenizer never changes while a run trains, so the history stores its files once per run: each
entry's are hard links to the identical files of the entry before (or of a sibling policy dir), and
every policy dir stays a complete from_pretrained dir while the 3.5 MB tokenizer.json of a
SmolLM2 is on the disk once, however many entries and agents; removing an entry leaves the others'
links whole. `agents/` keeps a copy of its own per policy dir: it is the export users take and edit.

`load_agents` is the way back (marl-llm-eval): exported tensors into a team's AgentPolicies.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from marl_llm.config import UserError, task_label
from marl_llm.runs.atomic import umask
from marl_llm.models.policies import AgentPolicies, lora_weights

AGENTS_DIR = "agents"
HISTORY_DIR = "checkpoints"
MANIFEST = "agents.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What makes each kind of export loadable, checked before an export is read back.
KIND_FILES = {"lora": ("adapter_config.json", ADAPTER_WEIGHTS), "full": ("config.json",)}


def base_model_name(policies: AgentPolicies, model_index: int) -> str:
    """The base model of `policies.models[model_index]` as a user passes it to from_pretrained:
    an absolute path for a local checkpoint (a relative model.path would not resolve from
    elsewhere), else the hub id."""
    name = str(policies.models[model_index].get_base_model().name_or_path)
    return os.path.abspath(name) if os.path.isdir(name) else name


def policy_dirs(policies: AgentPolicies) -> dict[tuple[int, str], str]:
    """A directory name per trained policy: its metric label (the agent's name, `shared`, or the
    policy_map name), made safe for a file name and unique."""
    names: dict[tuple[int, str], str] = {}
    for key in policies.trainable_adapters():
        name = re.sub(r"[^A-Za-z0-9._-]", "_", policies.policy_label(key)).lstrip(".") or "policy"
        while name in names.values() or name == MANIFEST:
            name += f"_{key[0]}"
        names[key] = name
    return names


def export_agents(run_dir: Path, cfg: Any, policies: AgentPolicies, step: int, target: Path | None = None,
                  whole: dict[int, dict[str, torch.Tensor] | Path] | None = None,
                  tokenizer_from: list[Path] | None = None) -> Path:
    """Write every trained policy to <run_dir>/agents/ (or `target`), replacing an earlier export
    atomically; returns that directory. `whole`: by model index, the state dicts of FSDP-sharded full
    models, gathered (fsdp.whole_policies), or the directory another rank wrote one to.
    `tokenizer_from`: earlier exports whose identical tokenizer files this one links to (hard links),
    as its policy dirs do to each other's (`link_identical`); None: a copy per policy dir."""
    run_dir = Path(run_dir)
    target = run_dir / AGENTS_DIR if target is None else Path(target)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    for leftover in parent.glob(f".{target.name}.*"):  # a killed export's temp or set-aside dir
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    try:
        dirs = policy_dirs(policies)
        state = None if policies.full else policies.adapter_state()
        for (k, adapter), name in dirs.items():
            agent_dir = tmp / name
            staged = (whole or {}).get(k)
            if isinstance(staged, Path):  # written by the first rank of its group (placement=groups)
                os.rename(staged, agent_dir)
            elif policies.full:
                policies.models[k].save_pretrained(agent_dir, state_dict=staged)
            else:
                _save_adapter(policies, k, adapter, state[f"{k}/{adapter}"], agent_dir)
            saved = policies.tokenizers[k].save_pretrained(agent_dir)
            if tokenizer_from is not None:
                link_identical([Path(f) for f in saved],
                               [d for export in (*tokenizer_from, tmp) for d in export.iterdir() if d.is_dir()])
            _write_card(agent_dir, cfg, policies, (k, adapter), step)
        agents = [{"name": a.name, "index": i, "dir": dirs[(a.model_index, a.adapter)],
                   "base_model": base_model_name(policies, a.model_index)} for i, a in enumerate(policies.agents)]
        manifest = {
            "kind": policies.kind, "step": step, "algo": str(cfg.algo.name), "task": str(cfg.task.name),
            "model": str(cfg.model.name), "chat_template": cfg.model.get("chat_template", "auto"),
            "chat_template_kwargs": dict(cfg.model.get("chat_template_kwargs") or {}),
            "agents": agents,
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n", encoding="utf-8")
        follow_umask(tmp)
        old = _set_aside(target) if target.exists() else None
        os.rename(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def link_identical(files: list[Path], dirs: list[Path]) -> None:
    """Replace each of `files` by a hard link to a file of the same name and bytes in one of `dirs`,
    where there is one: the bytes then exist once, and each dir still holds every file. Where the
    filesystem has no hard links (or a file's are at their limit), the copy stays."""
    for path in files:
        if not path.is_file():
            continue
        size = path.stat().st_size
        for directory in dirs:
            twin = directory / path.name
            try:
                if twin.samefile(path) or twin.stat().st_size != size or not filecmp.cmp(twin, path, shallow=False):
                    continue
                staged = path.with_name(f".{path.name}.link")
                os.link(twin, staged)
            except OSError:
                continue
            try:
                os.replace(staged, path)  # the copy or the link, never neither
            except OSError:
                staged.unlink(missing_ok=True)
            break


def _set_aside(directory: Path) -> Path:
    """Rename `directory` to a hidden sibling (a reader never sees it half removed); returns that."""
    aside = directory.with_name(f".{directory.name}.old-{os.getpid()}-{time.time_ns()}")
    os.rename(directory, aside)
    return aside


# ------------------------------------------------------------------------------------ history
def history_dirs(run_dir: Path) -> dict[int, Path]:
    """step -> <run_dir>/checkpoints/checkpoint-<step>/ of every kept export, in step order."""
    found = {}
    for d in (Path(run_dir) / HISTORY_DIR).glob("checkpoint-*"):
        step = d.name[len("checkpoint-"):]
        if step.isdigit() and (d / MANIFEST).is_file():
            found[int(step)] = d
    return dict(sorted(found.items()))


def export_history(run_dir: Path, cfg: Any, policies: AgentPolicies, step: int, keep: int | None,
                   whole: dict[int, dict[str, torch.Tensor] | Path] | None = None) -> Path:
    """The agents of `step` as <run_dir>/checkpoints/checkpoint-<step>/ (atomically, as agents/),
    its tokenizer files linked to the newest entry's, then only the `keep` newest of the history
    left (None: all); returns the new directory."""
    newest = list(history_dirs(run_dir).values())[-1:]
    target = export_agents(run_dir, cfg, policies, step, Path(run_dir) / HISTORY_DIR / f"checkpoint-{step}", whole,
                           tokenizer_from=newest)
    kept = history_dirs(run_dir)
    for old_step in list(kept)[: max(len(kept) - keep, 0)] if keep else []:
        shutil.rmtree(_set_aside(kept[old_step]), ignore_errors=True)
    return target


def agents_of_step(run_dir: Path, step: int) -> Path:
    """The export of the agents at `step`: its history dir, or agents/ when that export is of
    `step` (the end of training). UserError naming the steps there are."""
    history = history_dirs(run_dir)
    if step in history:
        return history[step]
    final = Path(run_dir) / AGENTS_DIR
    try:
        final_step = json.loads((final / MANIFEST).read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError):
        final_step = None
    if final_step == step:
        return final
    steps = [*history, *([final_step] if isinstance(final_step, int) and final_step not in history else [])]
    have = (f"it has the agents of step{'s' * (len(steps) != 1)} {', '.join(map(str, sorted(steps)))}" if steps
            else "it has no exported agents")
    raise UserError(f"{run_dir} has no agents of step {step} ({have}): pick one of those with --step, or keep a "
                    "history while training with trainer.history_every=<n> (and trainer.history_keep=<k>)")


def _save_adapter(policies: AgentPolicies, model_index: int, adapter: str, tensors: dict[str, torch.Tensor],
                  agent_dir: Path) -> None:
    """One adapter in peft's format in `agent_dir`, from `tensors` (its named LoRA weights)."""
    model = policies.models[model_index]
    staging = agent_dir.with_name(agent_dir.name + ".peft")
    model.save_pretrained(staging, selected_adapters=[adapter], state_dict=tensors)
    # peft writes a non-default adapter into a subfolder named after it (and a stub model card beside).
    os.rename(staging / adapter if (staging / adapter / "adapter_config.json").exists() else staging, agent_dir)
    shutil.rmtree(staging, ignore_errors=True)
    config_path = agent_dir / "adapter_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base_model_name(policies, model_index)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_card(agent_dir: Path, cfg: Any, policies: AgentPolicies, key: tuple[int, str], step: int) -> None:
    """README.md: which agent(s) of which team this is, its base model and how to load it."""
    team = policies.agent_names
    acting = [policies.agents[i].name for i in policies.agents_of(key)]
    base = base_model_name(policies, key[0])
    library = "transformers" if policies.full else "peft"
    roles = ", ".join(f"`{a}` (agent {team.index(a) + 1} of {len(team)})" for a in acting)
    chat = cfg.model.get("chat_template", "auto")
    prompts = ("raw text, no chat template (model.chat_template=false)" if chat is False or str(chat) == "false"
               else "the tokenizer's chat template" + (f" with {dict(cfg.model.chat_template_kwargs)}"
                                                       if cfg.model.get("chat_template_kwargs") else ""))
    where = f"<run_dir>/{AGENTS_DIR}/{agent_dir.name}"
    load = (f'from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained("{where}")'
            if policies.full else
            f'from peft import AutoPeftModelForCausalLM\nmodel = AutoPeftModelForCausalLM.from_pretrained("{where}")'
            "  # and its base")
    what = "a fully fine-tuned model" if policies.full else "a LoRA adapter"
    weights = ("\nWeights: every parameter as trained (fp32 master weights under bf16; from_pretrained(..., "
               "dtype=torch.bfloat16) halves them)." if policies.full else "")
    text = f"""---
base_model: {base}
library_name: {library}
tags: [marl-llm, {cfg.algo.name}, {task_label(cfg)}]
---
# {agent_dir.name}: {what} from a {cfg.algo.name} team on {task_label(cfg)}

Trained by marl-llm ({cfg.algo.name} on {task_label(cfg)}, step {step}) as {roles}; the team: {', '.join(team)}.
Base model: `{base}` ({cfg.model.name}). Prompts: {prompts}, as the task builds them.{weights}

```python
{load}
```
"""
    (agent_dir / "README.md").write_text(text, encoding="utf-8")


def follow_umask(root: Path) -> None:
    """Give `root` and everything in it the modes a plain open()/mkdir() would: mkdtemp makes the
    dir 0700, and safetensors writes its files 0600 (a temp file renamed into place), which would
    hide the agents from the colleagues the umask lets read them."""
    mask = umask()
    for where, _, files in os.walk(root):
        os.chmod(where, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(where, name), 0o666 & ~mask)


# ------------------------------------------------------------------------------------ loading
def read_manifest(agents_dir: Path) -> dict[str, Any]:
    """agents.json of an export, after checking each agent's directory has its files (UserError)."""
    path = Path(agents_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        kind, agents = manifest["kind"], manifest["agents"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not a marl-llm agents export ({type(err).__name__}: {err}); evaluate from the "
                        "checkpoint instead (--weights checkpoint)") from None
    for agent in agents:
        missing = [f for f in KIND_FILES.get(kind, ()) if not (Path(agents_dir) / agent["dir"] / f).is_file()]
        if missing:
            raise UserError(f"{Path(agents_dir) / agent['dir']} lacks {', '.join(missing)}; evaluate from the "
                            "checkpoint instead (--weights checkpoint)")
    return manifest


def _read_tensors(directory: Path, kind: str) -> dict[str, torch.Tensor]:
    """Every tensor of an exported policy: the adapter file, or all of a full model's shards."""
    from safetensors.torch import load_file

    if kind == "lora":
        return load_file(directory / ADAPTER_WEIGHTS)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(f"{directory} has no .safetensors weights; evaluate from the checkpoint instead "
                        "(--weights checkpoint)")
    return {name: t for f in files for name, t in load_file(f).items()}


def load_agents(policies: AgentPolicies, agents_dir: Path, manifest: dict[str, Any],
                source_agent: list[str]) -> None:
    """Load an export into `policies`: agent i acts with the policy that agent `source_agent[i]`
    of the export acted with (the same team, or another task's agents by position). Raises
    UserError when the export does not fit these policies (another kind, structure or shape)."""
    check_kind(manifest["kind"], policies, agents_dir)
    dir_of = {a["name"]: a["dir"] for a in manifest["agents"]}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for k, adapter in policies.trainable_adapters():
        wanted = [source_agent[i] for i in policies.agents_of((k, adapter))]
        dirs = {dir_of.get(name) for name in wanted}
        if len(dirs) != 1 or None in dirs:
            raise UserError(f"{Path(agents_dir) / MANIFEST}: the agents {wanted} do not share one exported policy, as "
                            f"{adapter} needs: evaluate with the run's algo.adapters / algo.policy_map")
        directory = Path(agents_dir) / dirs.pop()
        # peft stores a LoRA weight under its parameter name less the adapter's name.
        state[f"{k}/{adapter}"] = policy_tensors(policies, (k, adapter), _read_tensors(directory, manifest["kind"]),
                                                 lambda name: name.replace(f".{adapter}.", "."), directory)
    load_state(policies, state, agents_dir)


def check_kind(kind: str, policies: AgentPolicies, where: Any) -> None:
    """Refuse weights of the other kind (LoRA adapters vs full models) than `policies` build."""
    if kind != policies.kind:
        have, want = ("full models", "LoRA adapters") if kind == "full" else ("LoRA adapters", "full models")
        raise UserError(f"{where} holds {have} but this config builds {want}: keep the run's algo.lora")


def policy_tensors(policies: AgentPolicies, key: tuple[int, str], tensors: dict[str, torch.Tensor],
                   stored_name: Any, where: Any) -> dict[str, torch.Tensor]:
    """Policy `key`'s trained tensors by parameter name, each found in `tensors` under
    `stored_name(parameter name)` (LoRA weights only; with full fine-tuning every parameter,
    under its own name). UserError naming `where` when one is missing."""
    k, adapter = key
    model = policies.models[k]
    names = [n for n, _ in model.named_parameters()] if policies.full else list(lora_weights(model, adapter))
    stored = {n: n if policies.full else stored_name(n) for n in names}
    missing = [s for s in stored.values() if s not in tensors]
    if missing:
        raise UserError(f"{where} does not fit this config's policy {adapter} (no {missing[0]} among its "
                        f"{len(tensors)} tensors): evaluate with the run's model and algo.lora settings")
    return {n: tensors[s] for n, s in stored.items()}


def load_state(policies: AgentPolicies, state: dict[str, dict[str, torch.Tensor]], where: Any) -> None:
    """`policies.load_adapter_state`, with a mismatch (shapes, policies) as one UserError line."""
    try:
        policies.load_adapter_state(state)
    except (KeyError, RuntimeError) as err:
        raise UserError(f"{where} does not fit this config's policies ({' '.join(str(err).split())[:300]}): "
                        "evaluate with the run's model and algo.lora settings") from None
