"""Backend choice: auto says what it picked, unsloth where it cannot run fails before loading, and only a process
that trains with Unsloth imports it, before transformers, TRL and PEFT."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from finetune import backends
from tests.conftest import run_cli, write_recipe

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens on a machine without a GPU")


@no_gpu
def test_auto_picks_hf_without_a_gpu_and_says_so():
    assert backends.resolve("auto") == ("hf", "backend: hf (auto: no CUDA GPU)")
    assert backends.resolve("hf")[0] == "hf"


@no_gpu
def test_unsloth_without_a_gpu_fails_at_validation(tmp_path):
    result = run_cli("validate", "quickstart", "model.backend=unsloth", f"output_dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert result.stderr == ("error: model.backend: unsloth needs a CUDA GPU and this machine has none; "
                             "use model.backend=hf (or auto, which picks hf here)\n")


def test_requested_backend_is_read_without_validation(tmp_path):
    recipe = write_recipe(tmp_path, "model: {name_or_path: x, backend: unsloth}\n")
    assert backends.requested(str(recipe), []) == "unsloth"
    assert backends.requested(str(recipe), ["model.backend=hf"]) == "hf"
    assert backends.requested("quickstart", []) == "auto"
    assert backends.requested(str(write_recipe(tmp_path, "model: [broken\n", "bad.yaml")), []) == "auto"


@pytest.fixture
def probe_unsloth(tmp_path):
    """A stand-in `unsloth` package that records, when imported, which of transformers, trl and peft came first."""
    package = tmp_path / "site" / "unsloth"
    package.mkdir(parents=True)
    record = tmp_path / "imported.json"
    package.joinpath("__init__.py").write_text(
        "import json, sys\n"
        f"json.dump({{m: m in sys.modules for m in ('transformers', 'trl', 'peft')}}, open({str(record)!r}, 'w'))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    return env, record


def test_training_process_imports_unsloth_before_transformers(probe_unsloth):
    env, record = probe_unsloth
    script = ("from finetune import backends\n"
              "backends.resolve = lambda requested: ('unsloth', '')  # as on a CUDA machine\n"
              "backends.import_first('quickstart', [])\n"
              "import finetune.training_run\n")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    assert json.loads(record.read_text()) == {"transformers": False, "trl": False, "peft": False}


def test_validation_never_imports_unsloth(probe_unsloth, tmp_path):
    """With an importable unsloth package, neither the CLI nor validation imports it (they only look for it)."""
    env, record = probe_unsloth
    result = subprocess.run([sys.executable, "-m", "finetune", "validate", "quickstart",
                             f"output_dir={tmp_path / 'run'}", "train.max_length=64"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert not record.exists()


def test_unsloth_gets_every_lora_setting_dora_included(monkeypatch):
    """Unsloth's get_peft_model hands on to PEFT's LoraConfig the settings it does not name itself, DoRA among
    them: the recipe's lora section must reach it whole. (A stand-in records the call; Unsloth needs a GPU.)"""
    import types

    from finetune.config import load_recipe
    from finetune.model import _load_unsloth

    calls = {}

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**settings):
            return types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama")), None

        @staticmethod
        def get_peft_model(model, **settings):
            calls.update(settings)
            return model

    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    recipe = load_recipe("quickstart", ["method=lora", "lora.use_dora=true", "lora.use_rslora=true", "lora.r=4"])
    _load_unsloth(recipe, {"bf16": True, "fp16": False}, gradient_checkpointing=True)
    assert calls["use_dora"] is True and calls["use_rslora"] is True and calls["r"] == 4


def test_unsloth_is_refused_under_sharding_launchers():
    from finetune.errors import UserError

    for sharded in ("FSDP", "DEEPSPEED"):
        with pytest.raises(UserError, match=f"unsloth keeps a whole model on each GPU \\(DDP\\) and does not run under {sharded}"):
            backends.check_launch("unsloth", sharded)
    backends.check_launch("unsloth", "MULTI_GPU")
    backends.check_launch("hf", "FSDP")


def test_qlora_weights_are_stored_for_sharding_under_fsdp_and_zero3():
    """FSDP and ZeRO-3 shard only parameters of one floating-point dtype: 4-bit weights must be stored in the
    dtype of the others (bitsandbytes' default storage, uint8, cannot be sharded)."""
    from finetune.model import four_bit_config

    assert four_bit_config(torch.bfloat16, sharded=True).bnb_4bit_quant_storage == torch.bfloat16
    assert four_bit_config(torch.bfloat16, sharded=False).bnb_4bit_quant_storage == torch.uint8
