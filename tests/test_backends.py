"""Backend choice: auto says what it picked, unsloth where it cannot run fails before loading, and only a process
that trains with Unsloth imports it, before transformers, TRL and PEFT."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from finetune.errors import UserError
from finetune.models import backends
from tests.conftest import cli_here, run_cli, write_recipe

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


@pytest.fixture
def cuda_with_unsloth(tmp_path, monkeypatch):
    """This process as on a CUDA machine with the unsloth package installed (a stand-in package: Unsloth needs a
    GPU to import), for the choices `auto` makes there."""
    (tmp_path / "site" / "unsloth").mkdir(parents=True)
    (tmp_path / "site" / "unsloth" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_auto_takes_unsloth_only_on_the_path_it_is_checked_on(cuda_with_unsloth):
    assert backends.resolve("auto", "sft", {}, "MULTI_GPU") == \
        ("unsloth", "backend: unsloth (auto: a CUDA GPU and the unsloth package are here, SFT, a model per process)")
    assert backends.resolve("auto", "dpo", {}, "MULTI_GPU") == \
        ("hf", "backend: hf (auto: Unsloth is checked here for SFT only, and this is stage dpo; "
               "model.backend=unsloth asks for it)")
    assert backends.resolve("auto", "grpo")[0] == "hf"
    assert backends.resolve("auto", "sft", {}, "FSDP") == ("hf", "backend: hf (auto: Unsloth does not run under FSDP)")
    assert backends.resolve("auto", "sft", {}, "DEEPSPEED")[0] == "hf"
    assert backends.resolve("auto", "sft", {"use_liger_kernel": True}) == \
        ("hf", "backend: hf (auto: train.use_liger_kernel replaces the forward Unsloth patches)")
    assert backends.resolve("auto", "sft", {"activation_offloading": True})[0] == "hf"
    assert backends.resolve("unsloth", "dpo") == ("unsloth", "backend: unsloth (model.backend)")  # asked for


def test_auto_trains_every_family_with_unsloth_but_phi3_which_it_would_swap(cuda_with_unsloth, tmp_path):
    """Unsloth 2026.10.9 trains each family as named, except Microsoft's Phi-3, which it maps to its own copy laid out
    as Mistral: an adapter for modules the named Phi-3 does not have. auto takes hf there; asked for, it is refused."""
    from finetune.models.architectures import FAMILIES, tiny

    chosen = {}
    for family in FAMILIES:
        tiny(family).save_pretrained(tmp_path / family)
        chosen[family] = backends.resolve("auto", "sft", {}, "MULTI_GPU",
                                          lambda: backends.model_type_of(str(tmp_path / family)))
    swapped = ("Unsloth 2026.10.9 trains Microsoft's Phi-3 checkpoints as its own copies laid out as Mistral (q/k/v "
               "and gate/up split), whose adapter does not load on the Phi-3 the recipe names")
    assert chosen.pop("phi3") == ("hf", f"backend: hf (auto: {swapped})")
    assert {family: backend for family, (backend, _) in chosen.items()} == dict.fromkeys(chosen, "unsloth")
    with pytest.raises(UserError) as refused:
        backends.resolve("unsloth", model_type=lambda: backends.model_type_of(str(tmp_path / "phi3")))
    assert str(refused.value) == (f"model.backend: unsloth: {swapped}; name Unsloth's copy as model.name_or_path "
                                  "(unsloth/Phi-3-mini-4k-instruct, for one) to train that, or use model.backend=hf")


def test_the_model_type_is_read_without_transformers_from_a_folder_the_hub_cache_or_a_builtin(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from finetune.models.architectures import tiny

    commit = "0" * 40
    cached = tmp_path / "hub" / "models--microsoft--Phi-3-mini-4k-instruct"
    (cached / "refs").mkdir(parents=True)
    (cached / "refs" / "main").write_text(commit)
    tiny("phi3").save_pretrained(cached / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert backends.model_type_of("microsoft/Phi-3-mini-4k-instruct") == "phi3"
    assert backends.model_type_of(str(cached / "snapshots" / commit)) == "phi3"
    assert backends.model_type_of("builtin:tiny-llama") == "llama"
    assert backends.model_type_of("google/gemma-3-1b-it") is None  # not cached, offline: loading says why
    assert backends.model_type_of(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("key", ["use_liger_kernel", "activation_offloading"])
def test_unsloth_with_what_replaces_its_forward_is_refused_before_launch(key, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli_here(capsys, "validate", "quickstart", "model.backend=unsloth", f"train.{key}=true")
    assert code == 2 and err == (f"error: model.backend: unsloth patches the model's forward, and train.{key} "
                                 f"replaces it; remove train.{key}, or use model.backend=hf\n")


def test_shipped_recipes_name_their_backend():
    from finetune.resources import recipes_dir

    for recipe in recipes_dir().glob("*.yaml"):
        assert backends.requested(str(recipe), [])[0] in ("hf", "unsloth"), recipe.name


def test_the_settings_auto_decides_by_are_read_without_validation(tmp_path):
    recipe = write_recipe(tmp_path, "model: {name_or_path: x, backend: unsloth}\nstage: dpo\n"
                                    "train: {use_liger_kernel: true}\n")
    assert backends.requested(str(recipe), []) == \
        ("unsloth", "dpo", {"use_liger_kernel": True}, {"name_or_path": "x", "backend": "unsloth"})
    assert backends.requested(str(recipe), ["model.backend=auto", "stage=sft", "train.use_liger_kernel=false",
                                            "train.activation_offloading=true", "model.name_or_path=y",
                                            "model.revision=v2"]) == \
        ("auto", "sft", {"use_liger_kernel": False, "activation_offloading": True},
         {"name_or_path": "y", "backend": "unsloth", "revision": "v2"})
    assert backends.requested(str(write_recipe(tmp_path, "model: [broken\n", "bad.yaml")), []) == \
        ("auto", "sft", {}, {})


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
    script = ("from finetune.models import backends\n"
              "backends.resolve = lambda *settings: ('unsloth', '')  # as on a CUDA machine\n"
              "backends.import_first('quickstart', [])\n"
              "import finetune.training.run\n")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    assert json.loads(record.read_text()) == {"transformers": False, "trl": False, "peft": False}


@pytest.mark.parametrize("launched, family, imported", [
    ({}, "qwen3", True), ({"ACCELERATE_USE_FSDP": "true"}, "qwen3", False), ({}, "phi3", False)])
def test_the_training_process_imports_unsloth_where_auto_will_pick_it(launched, family, imported, probe_unsloth,
                                                                       tmp_path):
    """Before transformers loads, the training process decides as training will: not under FSDP, not for Phi-3."""
    from finetune.models.architectures import tiny

    env, record = probe_unsloth
    tiny(family).save_pretrained(tmp_path / "model")
    recipe = write_recipe(tmp_path, f"model: {{name_or_path: {tmp_path / 'model'}}}\n")
    script = ("import torch\n"
              "torch.cuda.is_available = lambda: True  # as on a CUDA machine\n"
              "from finetune.models import backends\n"
              f"backends.import_first({str(recipe)!r}, [])\n")
    subprocess.run([sys.executable, "-c", script], env={**env, **launched}, check=True, timeout=300)
    assert record.exists() == imported


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

    from finetune.models.loading import _load_unsloth
    from finetune.recipe.schema import load_recipe

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
    from finetune.models.loading import four_bit_config

    assert four_bit_config(torch.bfloat16, sharded=True).bnb_4bit_quant_storage == torch.bfloat16
    assert four_bit_config(torch.bfloat16, sharded=False).bnb_4bit_quant_storage == torch.uint8


def test_ddp_looks_for_unused_parameters_only_where_a_step_can_leave_some_without_gradient():
    """Unsloth skips GPT-OSS experts that no token reached: DDP must expect their missing gradients. Elsewhere the
    search is off (it costs a pass over the graph each step), and a recipe's own setting wins."""
    from finetune.recipe.schema import load_recipe
    from finetune.training.arguments import unused_parameter_search

    recipe = load_recipe("quickstart")
    assert unused_parameter_search(recipe, "unsloth", "gpt_oss") == \
        (True, "DDP unused-parameter search: on (GPT-OSS under Unsloth: experts no token reached get no gradient)")
    assert unused_parameter_search(recipe, "hf", "gpt_oss")[0] is False  # PEFT's expert LoRA is one tensor for all
    assert unused_parameter_search(recipe, "unsloth", "llama")[0] is False
    asked = load_recipe("quickstart", ["train.ddp_find_unused_parameters=true"])
    assert unused_parameter_search(asked, "hf", "llama") == \
        (True, "DDP unused-parameter search: on (train.ddp_find_unused_parameters)")


def test_a_run_saved_before_the_search_was_chosen_per_model_resumes(tmp_path):
    """Runs saved with the old fixed default (train.ddp_find_unused_parameters: false) resume under the new choice."""
    import yaml

    from finetune.recipe.schema import load_recipe
    from finetune.run_folder import CONFIG_NAME
    from finetune.training.resuming import check_same_run

    recipe = load_recipe("quickstart", [f"output_dir={tmp_path}"])
    saved = yaml.safe_load(recipe.to_yaml())
    saved["train"]["ddp_find_unused_parameters"] = False
    (tmp_path / CONFIG_NAME).write_text(yaml.safe_dump(saved))
    assert check_same_run(yaml.safe_load(recipe.to_yaml()), str(tmp_path)) is None
