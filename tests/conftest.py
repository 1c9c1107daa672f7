"""Shared fixtures. Tests never download: models are builtin or built from configs, tokenizers and datasets come
from ../shared/assets (or $FINETUNE_SHARED_ASSETS) and tests that need them skip with the reason when absent."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = Path(os.environ.get("FINETUNE_SHARED_ASSETS", REPO.parent / "shared" / "assets"))

# Every tensor over 32 MiB (glibc's largest mmap threshold: the loss's logits over a 128k or 201k vocabulary, for
# one) is a fresh mapping whose pages the kernel faults in and zeroes 4 KiB at a time; that was a third of the
# suite's training time on the CPU (llama-lora export test: 27.1 s of system time in 73.0 s; with transparent huge
# pages 8.4 s in 52.8 s). Set here, before pytest-xdist starts its workers, so that they and every process a test
# starts read it at their start; the kernel's THP "madvise" mode (the usual default) is what it needs.
HUGE_PAGES = "glibc.malloc.hugetlb=1"
if HUGE_PAGES not in os.environ.get("GLIBC_TUNABLES", ""):
    os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), HUGE_PAGES]))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores: torch's threads of two trainings at once, each as many as the cores, run several
    # times slower than one thread each. Set before torch is imported here or in any process a test starts.
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# The files that take longest go first, so that at the end of a run on two workers neither waits long for the other
# (pytest-xdist hands out whole files in this order: `--no-loadscope-reorder` in pyproject.toml keeps it from putting
# the files with most tests first instead); those that use the quickstart come after the long others, while it trains
# in the background (below); the quick ones fill in at the end.
LONGEST_FIRST = ["test_chat_export.py", "test_families.py", "test_stages.py", "test_faults.py", "test_resume.py", "test_training.py",
                 "test_recipes.py", "test_readme.py", "test_panel.py", "test_bad_input.py", "test_ray.py",
                 "test_benchmarks.py", "test_evaluate.py", "test_serve.py", "test_doctor.py", "test_backends.py",
                 "test_multinode.py", "test_time_plan.py", "test_memory_plan.py", "test_masks.py", "test_cli.py",
                 "test_data_pipeline.py"]


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


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


def launch_argv(accelerate_config: str, *options: str) -> list[str]:
    """`accelerate launch --config_file accelerate_configs/NAME.yaml [OPTIONS] -m finetune.train`, as the README
    launches: the recipe and its overrides follow."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "accelerate_configs" / f"{accelerate_config}.yaml"), *options, "-m", "finetune.train"]


def launch_cli(accelerate_config: str, *args: str, cwd: Path | None = None, timeout: float = 900,
               env: dict | None = None):
    """launch_argv's command with the recipe and overrides `args`, run to its end."""
    return subprocess.run([*launch_argv(accelerate_config), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def cli_here(capsys, *args: str) -> tuple[int, str, str]:
    """`finetune ARGS` in this process, for checks that need no fresh interpreter (no start-up paid, no
    environment of their own): its exit status, stdout and stderr."""
    from finetune.commands.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def train_here(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`finetune train ARGS` on one process, in this process: the interpreter's start and the libraries' imports
    (about 10 s) are not paid again. For runs whose test needs no environment of its own, no clean console and no
    peak memory of the process; its exit status and output come back as run_cli's do."""
    from finetune.commands.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd or Path.cwd()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", *args])
    return subprocess.CompletedProcess(["finetune", "train", *args], code, out.getvalue(), err.getvalue())


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


def built_once(tmp_path_factory, name: str, build) -> Any:
    """build(folder)'s result (JSON), built once for the whole test run: by the first pytest-xdist worker that asks,
    while the others wait for it and then read it. A build records failures in its result rather than raising."""
    from filelock import FileLock

    root = _shared_root(tmp_path_factory)
    result = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not result.exists():
            folder = root / name
            folder.mkdir()
            result.write_text(json.dumps(build(folder)))
    return json.loads(result.read_text())


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Random-init, scaled-down Llama 3.2 and GPT-OSS (24 layers, so layer-indexed settings apply unchanged), saved
    with the real tokenizers as ordinary Hugging Face folders."""
    from finetune.models.architectures import tiny_gpt_oss, tiny_llama_3_2

    asset("tokenizers/llama-3.2-instruct"), asset("tokenizers/gpt-oss")

    def build(folder: Path) -> dict[str, str]:
        return {"llama": str(save_tiny_model(folder / "llama", tiny_llama_3_2())),
                "gpt-oss": str(save_tiny_model(folder / "gpt-oss", tiny_gpt_oss(num_hidden_layers=24)))}

    return {name: Path(path) for name, path in built_once(tmp_path_factory, "tiny-models", build).items()}


def write_greetings(path: Path) -> Path:
    """One pattern a tiny model learns in a few dozen steps: reasoning "Greet." and the answer "Hi!"."""
    import random

    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(64):
            name = "".join(rng.choice("abcdefghij") for _ in range(5))
            out.write(json.dumps({"messages": [{"role": "user", "content": f"I am {name}."},
                                               {"role": "assistant", "content": "Hi!", "thinking": "Greet."}]}) + "\n")
    return path


def train_greeter(model: Path, data: Path, method: str, steps: int, learning_rate: float, batch: int,
                  run: Path) -> Path:
    """`finetune train` of a tiny model on write_greetings' data, here; the run folder."""
    result = train_here(
        "quickstart", f"model.name_or_path={model}", f"data.train={data}", f"method={method}", "data.eval_fraction=0",
        "train.eval_on_start=false", f"train.max_steps={steps}", f"train.learning_rate={learning_rate}",
        f"train.per_device_train_batch_size={batch}", "train.max_length=128", f"train.save_steps={steps}",
        "train.logging_steps=2", f"output_dir={run}",
        "train.lr_scheduler_type=constant_with_warmup",  # the rate the tests' steps were chosen with
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.fixture(scope="session")
def gpt_oss_greeter(tmp_path_factory) -> Path:
    """A two-layer GPT-OSS (experts, sinks, sliding window; the real tokenizer) fine-tuned in full until it reasons
    "Greet." and answers "Hi!", ending at <|return|>: one run for the chat, export and server tests."""
    from finetune.models.architectures import tiny_gpt_oss

    asset("tokenizers/gpt-oss")

    def build(folder: Path) -> str:
        model = save_tiny_model(folder / "model", tiny_gpt_oss())
        data = write_greetings(folder / "greetings.jsonl")
        return str(train_greeter(model, data, "full", 30, 5e-3, 2, folder / "gpt-oss-full"))

    return Path(built_once(tmp_path_factory, "gpt-oss-greeter", build))


def save_tiny_model(folder: Path, config, tokenizer=None) -> Path:
    """A random-init model of the config (seed 0) with the real tokenizer of its architecture (or the one given), as
    a HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tokenizer is None:
        path = {"llama": "tokenizers/llama-3.2-instruct", "gpt_oss": "tokenizers/gpt-oss"}[config.model_type]
        tokenizer = AutoTokenizer.from_pretrained(asset(path))
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


# Each family's official chat template, as TRL ships it (trl/chat_templates/); its tokenizer: the real one where it is
# in the shared assets (Qwen's), else Llama 3.2's vocabulary with the family's turn tokens added as special tokens, a
# stand-in that says so: the code paths (templates, masks, end tokens) are the family's, the vocabulary is not.
FAMILY_TEMPLATES = {"qwen2.5": "qwen2_5", "qwen3": "qwen3", "gemma2": "gemma", "gemma3": "gemma3", "phi3": "phi3",
                    "mistral": None}  # TRL ships no Mistral template: Llama 3.2's own stands in
STAND_IN_TURN_TOKENS = {  # the added tokens, and the end of text (eos_token) as the family's tokenizer names it
    "gemma2": (["<start_of_turn>", "<end_of_turn>", "<eos>"], "<eos>"),
    "gemma3": (["<start_of_turn>", "<end_of_turn>", "<eos>"], "<eos>"),
    "phi3": (["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], "<|endoftext|>"),
    "mistral": ([], None),
}


def family_tokenizer(family: str):
    """The family's tokenizer with its official chat template (see FAMILY_TEMPLATES)."""
    from importlib.resources import files

    from transformers import AutoTokenizer

    if family.startswith("qwen"):
        tokenizer = AutoTokenizer.from_pretrained(asset("tokenizers/qwen2"))
    else:
        tokenizer = AutoTokenizer.from_pretrained(asset("tokenizers/llama-3.2-instruct"))
        added, end = STAND_IN_TURN_TOKENS[family]
        tokenizer.add_special_tokens({"additional_special_tokens": added})
        if end:
            tokenizer.eos_token = end
    if FAMILY_TEMPLATES[family]:
        tokenizer.chat_template = (files("trl") / "chat_templates" / f"{FAMILY_TEMPLATES[family]}.jinja").read_text()
    return tokenizer


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

    def build(folder: Path) -> dict:
        rows = Path(resolve_dataset("builtin:greetings")).read_text().splitlines()
        data = folder / "greetings-37.jsonl"
        data.write_text("\n".join(rows[:37]) + "\n")
        two = launch_cli("cpu_ddp_2proc", "quickstart", f"data.train={data}", f"output_dir={folder / 'two'}",
                         "train.per_device_train_batch_size=2", *EQUAL_BATCH_EPOCH,
                         *(["train.report_to=[mlflow]"] if _installed("sqlalchemy") else []))
        # a fresh process, as the two DDP ranks are: the comparison is exact to 1e-4
        one = run_cli("train", "quickstart", f"data.train={data}", f"output_dir={folder / 'one'}",
                      "train.per_device_train_batch_size=4", *EQUAL_BATCH_EPOCH)
        return {"folder": str(folder), "data": str(data),
                **{name: [result.returncode, result.stdout, result.stderr] for name, result in (("one", one),
                                                                                                ("two", two))}}

    built = built_once(tmp_path_factory, "equal-batch", build)
    for name in ("two", "one"):
        assert built[name][0] == 0, built[name][2][-3000:]
    folder = Path(built["folder"])
    return EqualBatchRuns(Path(built["data"]), folder / "one", folder / "two",
                          {name: built[name][1] for name in ("one", "two")})


@dataclass
class QuickstartWorkspace:
    folder: Path  # the working directory of the README's quickstart command
    result: subprocess.CompletedProcess

    @property
    def run(self) -> Path:
        return self.folder / "runs" / "quickstart"


QUICKSTART_LIMIT_S = 2700  # a hang guard: 18 minutes on a 2-core machine half as fast as usual, beside two test workers


def _shared_root(tmp_path_factory) -> Path:
    """A folder of this test run that every pytest-xdist worker sees (the run's own base folder without xdist)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
    root = tmp_path_factory.getbasetemp().parent / f"built-once-{run}" if run else tmp_path_factory.getbasetemp()
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session", autouse=True)
def _quickstart_started_early(request, tmp_path_factory, isolated_home):
    """The README's quickstart takes minutes: when the collected tests need it, the first worker to start sets it
    training at once, in the background, beside the tests that do not need it."""
    if any("quickstart_workspace" in item.fixturenames for item in request.session.items):
        _start_quickstart(_shared_root(tmp_path_factory))


def _start_quickstart(root: Path) -> Path:
    from filelock import FileLock

    folder = root / "quickstart"
    with FileLock(str(root / "quickstart.lock")):
        if not folder.exists():
            folder.mkdir()
            command = f"{shlex.quote(str(Path(sys.executable).parent / 'finetune'))} train quickstart >stdout 2>stderr"
            # A home of its own: it prepares its data while the worker that started it runs other tests, some of
            # which check that nothing is left in their data cache.
            subprocess.Popen(["sh", "-c", f"{command}; echo $? >returncode.partial; mv returncode.partial returncode"],
                             cwd=folder, stdin=subprocess.DEVNULL, start_new_session=True,
                             env={**os.environ, "FINETUNE_HOME": str(root / "quickstart-home")})
    return folder


@pytest.fixture(scope="session")
def quickstart_workspace(tmp_path_factory) -> QuickstartWorkspace:
    """The README's quickstart, trained once from an empty working directory: the model that answers names."""
    import time

    folder = _start_quickstart(_shared_root(tmp_path_factory))
    deadline = time.monotonic() + QUICKSTART_LIMIT_S
    while not (folder / "returncode").exists():
        assert time.monotonic() < deadline, f"the quickstart did not end within {QUICKSTART_LIMIT_S} s"
        time.sleep(2)
    returncode = int((folder / "returncode").read_text().strip())
    return QuickstartWorkspace(folder, subprocess.CompletedProcess(
        ["finetune", "train", "quickstart"], returncode, (folder / "stdout").read_text(),
        (folder / "stderr").read_text()))
