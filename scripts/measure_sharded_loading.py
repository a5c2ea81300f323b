#!/usr/bin/env python3
"""Each rank's peak host memory while loading two fully fine-tuned policies under FSDP, sharded
loading (`trainer.fsdp_load=sharded`: built on the meta device, each rank reads its shards' rows)
against whole loading (`trainer.fsdp_load=whole`: whole copies on the CPU, then sharded), on 2 and 4
gloo ranks, measured with getrusage (results/sharded_loading.md, .json).

    .venv/bin/python scripts/measure_sharded_loading.py --out results

The model is a random Llama of 43M parameters (173 MB in fp32; its 49k-token embedding, tied to
the LM head, is the largest tensor), so that loading shows against the interpreter. A rank's
growth is measured from a baseline taken after a tokenizer is loaded (a fast tokenizer of 49k
tokens peaks at ~130 MB whatever the model) to the end of `fsdp.shard_policies`. tests/
test_sharded_loading.py runs `loading_growth` on its ranks and checks the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_model(path: Path) -> Path:
    """The random Llama described above, with the embedded model's tokenizer, saved to `path`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from marl_llm.models.loading import embedded_checkpoint

    tok = AutoTokenizer.from_pretrained(embedded_checkpoint())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def full_policy_configs(model_dir: str, dtype: str = "float32", kl_coef: float = 0.0):
    """(model config, algo config) of two fully fine-tuned policies (aux, main) on `model_dir`."""
    from omegaconf import OmegaConf

    model_cfg = OmegaConf.create(dict(name="mid", path=model_dir, embedded=False, hub_id=None, dtype=dtype,
                                      device="cpu", attn_implementation="sdpa", trust_remote_code=False,
                                      agent_bases=None))
    algo_cfg = OmegaConf.create(dict(adapters="per_agent", learning_rate=1e-3, weight_decay=0.01, policy_map={},
                                     lora=None, kl_coef=kl_coef))
    return model_cfg, algo_cfg


def loading_growth(model_dir: str, how: str) -> dict:
    """On a rank of a joined process group: load and shard the two policies `how` (sharded |
    whole); this rank's peak RSS growth while loading and the bytes it holds."""
    import resource

    from transformers import AutoTokenizer

    from marl_llm.distributed import fsdp
    from marl_llm.models.policies import AgentPolicies

    AutoTokenizer.from_pretrained(model_dir)  # the baseline holds a tokenizer (module docstring)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    policies = AgentPolicies(("aux", "main"), *full_policy_configs(model_dir), 0, load_on_cpu=True,
                             on_meta=how == "sharded")
    fsdp.shard_policies(policies)
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    params = [p for m in policies.models for p in m.parameters()]
    return {"how": how, "loading_rss_growth": growth,
            "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in params),
            "whole_bytes": sum(p.numel() * p.element_size() for p in params),
            "largest_rows_bytes": max(p.to_local().numel() * p.element_size() for p in params)}


def rank_side(model_dir: str, how: str, out_dir: str) -> None:
    from marl_llm.distributed import data_parallel as distributed

    w = distributed.init(timeout_min=5, cpu=True)
    figures = {"rank": w.rank, "ranks": w.size, **loading_growth(model_dir, how)}
    Path(out_dir, f"{how}_{w.size}_rank{w.rank}.json").write_text(json.dumps(figures))
    distributed.shutdown()


def table(rows: list[dict]) -> str:
    mib = 2**20
    lines = ["| ranks | loading | rank | peak RSS growth (MiB) | its shards (MiB) | largest tensor's rows (MiB) | both policies whole (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['how']} | {r['rank']} | {r['loading_rss_growth'] / mib:.0f} | "
                     f"{r['shard_bytes'] / mib:.0f} | {r['largest_rows_bytes'] / mib:.0f} | {r['whole_bytes'] / mib:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results", help="folder for sharded_loading.md and .json")
    ap.add_argument("--rank-side", nargs=3, metavar=("MODEL_DIR", "HOW", "OUT_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_side:
        rank_side(*args.rank_side)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        for ranks in (2, 4):
            for how in ("sharded", "whole"):
                cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(ranks),
                       "--master_port", os.environ.get("MASTER_PORT", "29500"), __file__,
                       "--rank-side", str(model_dir), how, tmp]
                subprocess.run(cmd, check=True, capture_output=True, text=True)
                rows += [json.loads(Path(tmp, f"{how}_{ranks}_rank{r}.json").read_text()) for r in range(ranks)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharded_loading.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "sharded_loading.md").write_text(
        "# Host memory while loading two fully fine-tuned policies under FSDP\n\n"
        "`scripts/measure_sharded_loading.py` on this machine's CPU, gloo ranks (torchrun): each rank's peak RSS "
        "growth (getrusage) from a baseline holding a tokenizer to the end of `fsdp.shard_policies`, for a random "
        "Llama of 43M parameters (173 MB fp32) per policy, two policies. `sharded` (trainer.fsdp_load=sharded, the "
        "default) builds them on the meta device and reads each rank's rows; `whole` (the earlier path) loads whole "
        "copies on the CPU first.\n\n" + table(rows) + "\n\nNot measured here: a GPU node. There the shards move "
        "to the GPU as they are read, so the host holds one tensor's rows at a time.\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
