"""The commands of the README and of every page in docs/ work as written (the GPU ones are checked for what they
name, since CI has no GPU), and the pages hold together: each linked from the README, the recipe reference
written from the recipe's own help strings."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.builtin import resolve_dataset
from tests.conftest import REPO, asset

README = (REPO / "README.md").read_text(encoding="utf-8")
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = "\n".join([README, *(page.read_text(encoding="utf-8") for page in DOCS)])  # the README's commands first
FINETUNE = str(Path(sys.executable).parent / "finetune")  # the console script of this environment


def commands(text: str = PAGES) -> list[str]:
    """The lines of the bash blocks, each command once, in the order the pages give them."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return list(dict.fromkeys(line.strip() for block in blocks for line in block.splitlines() if line.strip()))


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    argv[0] = FINETUNE if argv[0] == "finetune" else argv[0]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=900)


def test_exactly_two_install_commands_and_ci_runs_the_test_one():
    install = [c for c in commands(README) if c.startswith("pip install")]
    assert install == ['pip install -e . && finetune train quickstart', 'pip install -e ".[test]" && pytest']
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    steps = install[1].split(" && ")  # with the wheel's check between them
    assert all(step in ci for step in steps) and ci.index(steps[0]) < ci.index(steps[1])


def test_every_page_is_linked_from_the_readme_and_says_what_the_code_does():
    from finetune.commands.cli import build_parser
    from finetune.recipe.reference import markdown

    assert len(README.encode()) < 15_000, "the README is read in five minutes: details go to docs/"
    linked = set(re.findall(r"\(docs/([\w-]+\.md)\)", README))
    assert linked == {page.name for page in DOCS}, sorted({page.name for page in DOCS} ^ linked)
    assert (REPO / "docs" / "recipe-reference.md").read_text(encoding="utf-8") == markdown(), \
        "python -m finetune.recipe.reference > docs/recipe-reference.md"
    parser = build_parser()
    for command in commands():
        argv = shlex.split(command.rstrip("\\"))
        if argv[0] == "finetune" and "..." not in argv:
            parser.parse_known_args(argv[1:])  # an option that is no more exits here


def test_launch_commands_name_shipped_configs():
    """Every accelerate config a README command names, by name (--accelerate-config) or by path (accelerate launch
    --config_file), is a shipped one."""
    named = []
    for argv in map(shlex.split, commands()):
        for option in ("--accelerate-config", "--config_file"):
            if option in argv:
                named.append(argv[argv.index(option) + 1])
    assert len(named) >= 8 and any(name.startswith("accelerate_configs/") for name in named)
    for name in named:
        shipped = REPO / name if name.startswith("accelerate_configs/") else REPO / "accelerate_configs" / f"{name}.yaml"
        assert shipped.is_file(), name
    assert any(c.startswith("accelerate launch") and "-m finetune.train" in c for c in commands())


def test_gpu_recipe_commands_name_shipped_recipes_and_configs():
    recipe_commands = [shlex.split(c) for c in commands() if c.startswith("finetune train") and "--accelerate-config" in c
                       and "quickstart" not in c and "my-recipe" not in c]
    assert len(recipe_commands) == 8
    for argv in recipe_commands:
        assert (REPO / "configs" / f"{argv[2]}.yaml").is_file(), argv
        assert (REPO / "accelerate_configs" / f"{argv[argv.index('--accelerate-config') + 1]}.yaml").is_file(), argv
        recipe_header = (REPO / "configs" / f"{argv[2]}.yaml").read_text(encoding="utf-8")
        assert " ".join(argv) in recipe_header, "the README and the recipe's header give the same launch command"


@pytest.mark.integration
def test_quickstart_learns_and_answers_prompts_it_never_saw(quickstart_workspace):
    """The README's first command, after its install step, from an empty working directory (the fixture runs it)."""
    install, quickstart = commands()[0].split(" && ")
    assert quickstart == "finetune train quickstart"
    tmp_path, result = quickstart_workspace.folder, quickstart_workspace.result
    assert result.returncode == 0, result.stderr[-3000:]
    assert not foreign_lines(result.stderr), foreign_lines(result.stderr)  # the training bar alone
    preparing = [line for line in result.stdout.splitlines() if line.startswith("preparing train")]
    assert all(" 0 rows/s" not in line for line in preparing), preparing  # no time left before there is a rate
    run_dir = tmp_path / "runs" / "quickstart"
    rows = [json.loads(line) for line in (run_dir / "progress.jsonl").read_text().splitlines()]
    assert rows[-1]["status"] == "completed"
    evals = [row["eval_loss"] for row in rows if "eval_loss" in row]
    assert evals[-1] <= evals[0] / 2, evals
    train_rows = [row for row in rows if "loss" in row]
    for key in ("step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_second", "tokens",
                "trained_tokens", "peak_memory_gb", "elapsed_s"):
        assert all(key in row for row in train_rows), key
    assert (run_dir / "finetune.yaml").is_file() and (run_dir / "train.log").stat().st_size > 0
    assert all((c / "finetune.yaml").is_file() for c in run_dir.glob("checkpoint-*"))
    assert (run_dir / "final" / "finetune.yaml").is_file()
    assert "completed: runs/quickstart/final" in result.stdout

    names = ["Zorbel", "Christopher", "Maximilian", "Mary Jane", "Ann", "Bo", "Alexandra Rose"]  # names of 2 to 14 letters, as trained
    unseen = [*names, "plimbo", "zendu"]
    training_data = Path(resolve_dataset("builtin:greetings")).read_text()
    assert not any(f"{word}!" in training_data or f" {word.lower()} " in training_data for word in unseen)
    answers = generate(run_dir / "final", [*(f"My name is {name}." for name in names), "Shout plimbo.",
                                           "Repeat zendu twice."])
    assert answers == [*(f"Nice to meet you, {name}!" for name in names), "PLIMBO!", "zendu zendu"]

    samples = [row for row in rows if "samples" in row]
    assert [row["step"] for row in samples] == [row["step"] for row in rows if "eval_loss" in row]
    assert all(len(row["samples"]) == 4 for row in samples)
    assert samples[-1]["samples_stop_rate"] == 1.0 and samples[0]["samples_stop_rate"] == 0.0
    assert all(sample["answer"] == sample["reference"] for sample in samples[-1]["samples"])

    evaluation = run(next(c for c in commands() if c.startswith("finetune eval") and "--data" in c), tmp_path)
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    results = {name: json.loads((run_dir / "eval" / f"{name}-builtin_unseen-names.json").read_text())
               for name in ("final", "base")}
    trained, base = results["final"]["metrics"], results["base"]["metrics"]
    assert results["final"]["examples"] == results["base"]["examples"] == 200
    assert trained["exact_match"] >= 0.95 and trained["stop_rate"] == 1.0, trained
    assert base["exact_match"] <= 0.02 and trained["loss"] < 0.1 < 5.0 < base["loss"], base
    table = evaluation.stdout
    assert "| metric | runs/quickstart | base:runs/quickstart |" in table
    assert f"| exact_match | {100 * trained['exact_match']:.1f}% | 0.0% |" in table
    answers = (run_dir / "eval" / "final-builtin_unseen-names.answers.jsonl").read_text().splitlines()
    first = json.loads(answers[0])
    assert len(answers) == 200 and first["prompt"].startswith("My name is ") and first["stopped"] is True
    tasks = run(next(c for c in commands() if c.startswith("finetune eval") and "--tasks" in c), tmp_path)
    assert tasks.returncode == 0, tasks.stderr[-3000:]
    assert json.loads((run_dir / "eval" / "final-tasks.json").read_text())["tasks"][
        "finetune_greetings/exact_match"] >= 0.8, tasks.stdout

    chat = run(next(c for c in commands() if c.startswith("finetune chat")), tmp_path)
    assert chat.returncode == 0 and chat.stdout == "Nice to meet you, Zorbel!\n", chat.stderr[-3000:]
    export = run(next(c for c in commands() if c.startswith("finetune export")), tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    assert "exported the model to exports/quickstart (checked: logits within" in export.stdout
    assert generate(tmp_path / "exports" / "quickstart", ["Shout plimbo."]) == ["PLIMBO!"]  # in bf16
    exported = subprocess.run([FINETUNE, "eval", "exports/quickstart", "--data", "builtin:unseen-names", "--limit", "20",
                               "--out", "evals"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert json.loads((tmp_path / "evals" / "exports_quickstart.json").read_text())["metrics"]["exact_match"] >= 0.9
    assert len((tmp_path / "evals" / "exports_quickstart.answers.jsonl").read_text().splitlines()) == 20
    card = (tmp_path / "exports" / "quickstart" / "README.md").read_text()
    assert f"| builtin:unseen-names (200 examples) | exact_match | {100 * trained['exact_match']:.1f}% | 0.0% |" in card
    assert "| lm-evaluation-harness | finetune_greetings/exact_match |" in card


@pytest.mark.integration
def test_a_two_process_run_prints_only_its_own_lines(tmp_path):
    """Data prepared on worker processes (5,880 rows), then trained by two DDP processes: nothing on stderr but
    the training bar (no traceback, no leaked-resource warning from the workers' pool)."""
    result = subprocess.run(
        [FINETUNE, "train", "quickstart", "--accelerate-config", "cpu_ddp_2proc", "train.max_steps=2",
         "train.max_length=200", "train.eval_on_start=false", "data.eval_fraction=0", "train.save_strategy=no",
         "eval.samples=0", f"output_dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Prepared the data in " in result.stdout, result.stdout  # prepared by this run (progress lines only if slow)
    # A DDP run of a test on the other worker may hold accelerate's default port meanwhile: that warning is the
    # parallel suite's, not the README command's.
    lines = [line for line in foreign_lines(result.stderr)
             if "is already in use" not in line and line.strip() != "warnings.warn("]
    assert not lines, lines


def foreign_lines(stderr: str) -> list[str]:
    """What a run printed on stderr besides tqdm's progress bars (an evaluation's bar, nested in the training bar,
    ends its lines with the terminal's cursor-up code)."""
    bar = re.compile(r"^\s*(\d+%\|.*\|.*(it/s|s/it|\?it/s)\]?)?\s*(\x1b\[A)?\s*$")
    return [line for line in re.split(r"[\r\n]", stderr) if not bar.match(line)]


def generate(folder: Path, prompts: list[str]) -> list[str]:
    """Greedy answers from the saved model with plain transformers, using the chat template saved with it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    answers = []
    for prompt in prompts:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        output = model.generate(**inputs, max_new_tokens=40, do_sample=False)
        answers.append(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return answers


@pytest.mark.integration
def test_validate_command(tmp_path):
    result = run(next(c for c in commands() if c.startswith("finetune validate")), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK: the recipe and its data are valid." in result.stdout


@pytest.mark.integration
def test_data_checks_command_prints_what_its_page_shows(tmp_path):
    page = (REPO / "docs" / "validate.md").read_text(encoding="utf-8")
    section = page[page.index("## Know your data before step 0"):]
    result = run(commands(section)[0], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    shown = re.search(r"```text\n(.*?)```", section, re.S)[1].splitlines()
    assert shown and all(line in result.stdout.splitlines() for line in shown), result.stdout


@pytest.mark.integration
def test_prepare_and_train_from_prepared_commands(tmp_path):
    prepare = run(next(c for c in commands() if c.startswith("finetune prepare")), tmp_path)
    assert prepare.returncode == 0 and not prepare.stderr, prepare.stderr[-3000:]
    assert "prepared/quickstart: prepared: " in prepare.stdout
    train = run(next(c for c in commands() if c.startswith("finetune train") and "data.prepared=" in c), tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    assert not foreign_lines(train.stderr), foreign_lines(train.stderr)
    assert "Prepared the data" not in train.stdout  # read from the folder, not prepared again
    rows = [json.loads(line) for line in (tmp_path / "runs" / "from-prepared" / "progress.jsonl").read_text()
            .splitlines()]
    assert rows[-1] == {**rows[-1], "status": "completed", "step": 5}


@pytest.mark.integration
def test_cpu_ddp_and_resume_commands(tmp_path):
    result = run(next(c for c in commands() if "cpu_ddp_2proc" in c), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    progress = tmp_path / "runs" / "ddp-try" / "progress.jsonl"
    rows = [json.loads(line) for line in progress.read_text().splitlines()]
    assert rows[-1] == {**rows[-1], "status": "completed", "step": 20}
    resumed = run(next(c for c in commands() if "--resume" in c), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in progress.read_text().splitlines()]
    assert rows[-1] == {**rows[-1], "status": "completed", "step": 40}
    assert [row["resumed"]["from"] for row in rows if "resumed" in row] == ["checkpoint-20"]


@pytest.mark.integration
def test_ray_command(tmp_path):
    pytest.importorskip("ray.train", reason="the ray extra is not installed")
    result = run(next(c for c in commands() if "--engine ray" in c), tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "ray-try" / "progress.jsonl").read_text().splitlines()]
    assert rows[-1] == {**rows[-1], "status": "completed", "step": 20}
    assert "completed: runs/ray-try/final" in result.stdout


@pytest.mark.integration
def test_mlflow_commands(tmp_path):
    pytest.importorskip("sqlalchemy", reason="the mlflow extra is not installed")
    from mlflow import MlflowClient

    train, export = [c for c in commands() if "runs/tracked" in c]
    result = run(train, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert f"open it with: mlflow ui --backend-store-uri {store}" in result.stdout
    exported = run(export, tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"registered: greeter version 1 in {store}" in exported.stdout
    client = MlflowClient(store)
    [tracked] = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tracked" / "progress.jsonl").read_text().splitlines()]
    history = client.get_metric_history(tracked.info.run_id, "loss")
    assert [point.step for point in history] == [row["step"] for row in rows if "loss" in row] and history


@pytest.mark.integration
def test_gpu_check_dry_run_command(tmp_path):
    """On a CPU the GPU check runs at tiny sizes: packed examples are kept apart, the transformers ways are measured
    against the plan, and Unsloth's checks say why they are skipped."""
    asset("tokenizers/llama-3.2-instruct")
    command = next(c for c in commands() if "gpu_check.py" in c and "--tiny" in c)
    result = run(command.replace("python ", f"{sys.executable} {REPO}/", 1), tmp_path)
    results = json.loads((tmp_path / "gpu-check-dry-run" / "results.json").read_text())
    checks = results["checks"]
    failed = [name for name, check in checks.items() if check["verdict"] == "FAIL"]
    assert result.returncode == (1 if failed else 0), result.stderr[-3000:]
    assert checks["packing llama hf"]["verdict"] == "PASS"
    assert checks["packing llama unsloth"] == {"verdict": "SKIP", "figure": "Unsloth needs a CUDA GPU", "seconds": 0.0}
    for way in ("hf-qlora", "hf-lora"):
        figures = results["figures"][f"llama {way}"]
        assert figures["tokens_per_second"] > 0 and figures["peak_gib"] > 0 and figures["planned_gib"] > 0
        assert checks[f"speed llama {way}"]["verdict"] in ("PASS", "FAIL")  # FAIL: the plan is off by over 15%
    assert "PASS packing llama hf: second example's logits, packed vs alone" in result.stdout
    assert "SKIP speed llama unsloth-qlora: Unsloth needs a CUDA GPU" in result.stdout


@pytest.mark.integration
def test_panel_command_serves_the_page(tmp_path):
    import signal
    import socket
    import time
    import urllib.request

    pytest.importorskip("gradio", reason="the panel's extra is not installed: pip install -e '.[ui]'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = shlex.split(next(c for c in commands() if c.startswith("finetune ui")))
    panel = subprocess.Popen([FINETUNE, *argv[1:], "--port", str(port)], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert panel.poll() is None, panel.stdout.read()
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert "finetune" in page
        assert {"recipes", "runs", "exports", ".launches"} <= {p.name for p in tmp_path.iterdir()}
    finally:
        os.killpg(panel.pid, signal.SIGTERM)
        panel.wait(timeout=30)
