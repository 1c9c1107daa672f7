"""Shared fixtures. Tests never download: models are builtin or built from configs, tokenizers and datasets come
from ../shared/assets (or $FINETUNE_SHARED_ASSETS) and tests that need them skip with the reason when absent."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = Path(os.environ.get("FINETUNE_SHARED_ASSETS", REPO.parent / "shared" / "assets"))


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory):
    """Builtin models and the data cache go to a fresh folder, never the user's; the Hub is never contacted."""
    home = tmp_path_factory.mktemp("finetune-home")
    saved = {key: os.environ.get(key) for key in ("FINETUNE_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update(FINETUNE_HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def asset(relative: str) -> Path:
    path = ASSETS / relative
    if not path.exists():
        pytest.skip(f"{path} is absent: the shared test assets (../shared/assets or $FINETUNE_SHARED_ASSETS) are needed")
    return path


@pytest.fixture(scope="session")
def llama_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(asset("tokenizers/llama-3.2-instruct"))


@pytest.fixture(scope="session")
def gptoss_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(asset("tokenizers/gpt-oss"))


@pytest.fixture(scope="session")
def builtin_tokenizer():
    from finetune.builtin import make_tokenizer

    return make_tokenizer()


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 900, module: str = "finetune",
            env: dict | None = None, input: str | None = None):
    """Run `python -m finetune ...` (or another module) as a user would; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
        input=input,
    )


def cli_here(capsys, *args: str) -> tuple[int, str, str]:
    """`finetune ARGS` in this process, for checks that need no fresh interpreter (no start-up paid, no
    environment of their own): its exit status, stdout and stderr."""
    from finetune.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def write_recipe(folder: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def trained_spans(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The runs of tokens that carry loss, decoded, in order."""
    spans, current = [], []
    for token, label in zip(ids, labels):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tokenizer.decode(span, clean_up_tokenization_spaces=False) for span in spans]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Random-init, scaled-down Llama 3.2 and GPT-OSS (24 layers, so layer-indexed settings apply unchanged), saved
    with the real tokenizers as ordinary Hugging Face folders."""
    from finetune.models.architectures import tiny_gpt_oss, tiny_llama_3_2

    return {"llama": save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tiny_llama_3_2()),
            "gpt-oss": save_tiny_model(tmp_path_factory.mktemp("tiny-gpt-oss"), tiny_gpt_oss(num_hidden_layers=24))}


def save_tiny_model(folder: Path, config) -> Path:
    """A random-init model of the config (seed 0) with the real tokenizer of its architecture, as a HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = {"llama": "tokenizers/llama-3.2-instruct", "gpt_oss": "tokenizers/gpt-oss"}[config.model_type]
    AutoTokenizer.from_pretrained(asset(tokenizer)).save_pretrained(folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


# A few fast steps of the quickstart recipe, with LoRA, one loss per step and nothing random left unseeded.
SHORT = [
    "method=lora", "train.max_steps=6", "train.logging_steps=1", "train.eval_on_start=false",
    "train.eval_strategy=no", "data.eval_fraction=0", "train.save_strategy=no", "train.learning_rate=1e-3",
    "train.warmup_steps=0",
]
# One epoch of 37 rows in global batches of 4: 10 steps, the last batch completed from its own window.
EQUAL_BATCH_EPOCH = [*SHORT, "train.max_steps=-1", "train.num_train_epochs=1", "train.packing=false",
                     "train.max_length=64"]


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@dataclass
class EqualBatchRuns:
    data: Path
    one: Path  # one process, micro-batch 4
    two: Path  # two accelerate (gloo) processes, micro-batch 2, tracked in MLflow where its extra is installed
    outputs: dict[str, str]


@pytest.fixture(scope="session")
def equal_batch_runs(tmp_path_factory) -> EqualBatchRuns:
    """The same global batch trained by one process and by two DDP processes (the engines' reference)."""
    from finetune.builtin import resolve_dataset

    folder = tmp_path_factory.mktemp("equal-batch")
    rows = Path(resolve_dataset("builtin:greetings")).read_text().splitlines()
    data = folder / "greetings-37.jsonl"
    data.write_text("\n".join(rows[:37]) + "\n")
    two = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(REPO / "accelerate_configs" / "cpu_ddp_2proc.yaml"), "-m", "finetune.train", "quickstart",
         f"data.train={data}", f"output_dir={folder / 'two'}", "train.per_device_train_batch_size=2",
         *EQUAL_BATCH_EPOCH, *(["train.report_to=[mlflow]"] if _installed("sqlalchemy") else [])],
        capture_output=True, text=True, timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_cli("train", "quickstart", f"data.train={data}", f"output_dir={folder / 'one'}",
                  "train.per_device_train_batch_size=4", *EQUAL_BATCH_EPOCH)
    assert one.returncode == 0, one.stderr[-3000:]
    return EqualBatchRuns(data, folder / "one", folder / "two", {"one": one.stdout, "two": two.stdout})


@dataclass
class QuickstartWorkspace:
    folder: Path  # the working directory of the README's quickstart command
    result: subprocess.CompletedProcess

    @property
    def run(self) -> Path:
        return self.folder / "runs" / "quickstart"


@pytest.fixture(scope="session")
def quickstart_workspace(tmp_path_factory) -> QuickstartWorkspace:
    """The README's quickstart, trained once from an empty working directory: the model that answers names."""
    folder = tmp_path_factory.mktemp("quickstart")
    result = subprocess.run([str(Path(sys.executable).parent / "finetune"), "train", "quickstart"], cwd=folder,
                            capture_output=True, text=True, timeout=900)
    return QuickstartWorkspace(folder, result)
