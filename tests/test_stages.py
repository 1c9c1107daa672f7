"""Stages beyond SFT: DPO, KTO and GRPO through TRL's trainers, on a task the tests build.

The task: asked to pick a color, a small model answers "red" or "blue", half and half (SFT in full from random
weights, then a LoRA adapter on top). Preferences and rewards then ask for blue: DPO's reward margin and preference
accuracy rise, GRPO's mean reward rises, both starting from the SFT run's adapter (model.adapter). DPO runs with
TRL's loss_type [sigmoid, sft] (RPO: the chosen answer's likelihood as well); without it, DPO on a model this small
lowers the chosen answer's likelihood too, and its greedy answers fall apart.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, asset, cli_here, launch_argv, launch_cli, run_cli, train_here, write_recipe

PROMPTS = ["Pick a color.", "Choose a color.", "Name a color.", "Say a color.", "Which color?", "A color, please."]
TRAIN = ["train.max_length=64", "train.gradient_checkpointing=false", "train.save_strategy=no",
         "train.logging_steps=5", "train.warmup_steps=0"]


def progress(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]


def train(folder: Path, recipe: str, *overrides: str) -> Path:
    result = train_here(recipe, *TRAIN, *overrides, cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    assert progress(folder / "runs" / Path(recipe).stem)[-1]["status"] == "completed"
    return folder / "runs" / Path(recipe).stem


@dataclass
class ColorRuns:
    folder: Path
    base: Path  # full SFT: answers red or blue
    sft: Path  # a LoRA adapter trained on top of it
    dpo: Path  # DPO from the SFT adapter, preferring blue (and grpo.yaml, rewarding blue, written beside)


@pytest.fixture(scope="module")
def color_runs(tmp_path_factory) -> ColorRuns:
    folder = tmp_path_factory.mktemp("colors")
    rng = random.Random(0)
    with open(folder / "colors.jsonl", "w") as out:
        for _ in range(256):
            out.write(json.dumps({"messages": [{"role": "user", "content": rng.choice(PROMPTS)},
                                               {"role": "assistant", "content": rng.choice(["red", "blue"])}]}) + "\n")
    with open(folder / "prefs.jsonl", "w") as out:
        for _ in range(128):
            out.write(json.dumps({"prompt": [{"role": "user", "content": rng.choice(PROMPTS)}],
                                  "chosen": "blue", "rejected": "red"}) + "\n")
    write_recipe(folder, "model: {name_or_path: builtin:tiny-llama}\nmethod: full\ndata: {train: colors.jsonl}\n"
                 "train: {max_steps: 120, per_device_train_batch_size: 16, learning_rate: 2.0e-3}\n", "base.yaml")
    base = train(folder, "base.yaml")
    write_recipe(folder, f"model: {{name_or_path: {base / 'final'}}}\ndata: {{train: colors.jsonl}}\n"
                 "train: {max_steps: 10, per_device_train_batch_size: 16, learning_rate: 1.0e-3}\n", "sft.yaml")
    sft = train(folder, "sft.yaml")
    write_recipe(folder, f"stage: dpo\nmodel: {{adapter: {sft}}}\ndata: {{train: prefs.jsonl, eval_fraction: 0.1}}\n"
                 "dpo: {beta: 0.1, loss_type: [sigmoid, sft]}\n"
                 "train: {max_steps: 30, per_device_train_batch_size: 8, learning_rate: 2.0e-3,\n"
                 "  eval_steps: 15, eval_on_start: true}\n", "dpo.yaml")
    dpo = train(folder, "dpo.yaml")
    write_recipe(folder, f"stage: grpo\nmodel: {{adapter: {sft}}}\ndata: {{train: colors.jsonl}}\n"
                 "grpo: {num_generations: 8, max_completion_length: 8, rewards: [{function: format, pattern: ^blue}]}\n"
                 "train: {max_steps: 40, per_device_train_batch_size: 8, learning_rate: 3.0e-3}\n", "grpo.yaml")
    return ColorRuns(folder, base, sft, dpo)


def test_dpo_from_an_sft_adapter_raises_the_margin_and_accuracy(color_runs):
    rows = progress(color_runs.dpo)
    logged = [row for row in rows if "loss" in row]
    first, last = logged[0], logged[-1]
    assert last["rewards/margins"] > first["rewards/margins"] + 0.2
    assert last["rewards/accuracies"] == 1.0 and last["loss"] < first["loss"]
    evals = [row for row in rows if "eval_rewards/margins" in row]
    assert [row["step"] for row in evals] == [0, 15, 30]
    assert evals[0]["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as its reference
    assert evals[-1]["eval_rewards/margins"] > 0.2 and evals[-1]["eval_rewards/accuracies"] == 1.0
    # the adapter continued is the SFT run's, and the reference copy of it is not saved with the model
    recipe = (color_runs.dpo / "final" / "finetune.yaml").read_text()
    assert f"adapter: {color_runs.sft / 'final'}" in recipe and "stage: dpo" in recipe
    assert not (color_runs.dpo / "final" / "ref").exists()


def test_dpo_run_chats_exports_and_evaluates(color_runs, tmp_path, capsys, monkeypatch):
    """The DPO model answers blue where the SFT model picks either; its export says how it was trained."""
    monkeypatch.chdir(color_runs.folder)
    code, answer, err = cli_here(capsys, "chat", str(color_runs.dpo), "--prompt", "Pick a color.", "--temperature", "0")
    assert code == 0 and answer.strip().endswith("blue"), err[-2000:]
    code, table, err = cli_here(capsys, "eval", str(color_runs.dpo), str(color_runs.sft), "--data", "prefs.jsonl",
                                "--limit", "24")
    assert code == 0, err[-2000:]
    exact = next(line for line in table.splitlines() if line.startswith("| exact_match |"))
    dpo, sft = (float(cell.split("%")[0]) for cell in exact.split("|")[2:4])  # the chosen answer is the reference
    assert dpo == 100.0 and sft < 90.0, exact
    out = tmp_path / "export"
    code, _, err = cli_here(capsys, "export", str(color_runs.dpo / "final"), "--out", str(out))
    assert code == 0, err[-2000:]
    card = (out / "README.md").read_text()
    assert "TRL's `DPOTrainer`" in card and "| stage | dpo (beta 0.1" in card and "- dpo" in card
    assert (out / "adapter_model.safetensors").is_file() and not (out / "ref").exists()


def test_grpo_learns_the_rewarded_answer(color_runs):
    """Rewarded for answers that start with "blue", the mean reward rises from about one half to at least 0.6."""
    run = train(color_runs.folder, "grpo.yaml")
    rewards = [row["rewards/format/mean"] for row in progress(run) if "loss" in row]
    assert len(rewards) == 8 and rewards[0] < 0.6
    assert sum(rewards[-2:]) / 2 >= 0.6 and sum(rewards[-2:]) / 2 > rewards[0] + 0.15
    assert all("reward" in row and "completions/mean_length" in row for row in progress(run) if "loss" in row)


def test_kto_runs_on_pairs_split_into_labelled_answers(color_runs):
    write_recipe(color_runs.folder, f"stage: kto\nmodel: {{adapter: {color_runs.sft}}}\n"
                 "data: {train: prefs.jsonl}\ntrain: {max_steps: 10, per_device_train_batch_size: 8, "
                 "learning_rate: 1.0e-3}\n", "kto.yaml")
    result = train_here("kto.yaml", *TRAIN, cwd=color_runs.folder)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train: 256 labelled answers" in result.stdout  # 128 pairs: each chosen desirable, each rejected not
    rows = [row for row in progress(color_runs.folder / "runs" / "kto") if "loss" in row]
    assert len(rows) == 2 and all("rewards/chosen_sum" in row or "rewards/chosen" in row for row in rows)


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_a_full_fine_tune_takes_a_reference_model_loaded_as_the_policy(stage, tmp_path):
    """The quickstart trains in full: DPO and KTO then need a reference model of their own, which must load as the
    policy does (TRL built it from the model's path by itself, from the builtin config that named no architecture,
    and crashed). At the first step the policy is its reference: rewards 0."""
    rng = random.Random(1)
    with open(tmp_path / "prefs.jsonl", "w") as out:
        for _ in range(32):
            out.write(json.dumps({"prompt": [{"role": "user", "content": rng.choice(PROMPTS)}],
                                  "chosen": "blue", "rejected": "red"}) + "\n")
    result = train_here("quickstart", f"stage={stage}", "data.train=prefs.jsonl", "data.eval_fraction=0",
                     *TRAIN, "train.eval_on_start=false", "train.max_steps=2", "train.logging_steps=1",
                     "train.per_device_train_batch_size=4", "eval.samples=0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = progress(tmp_path / "runs" / "quickstart")
    assert rows[-1]["status"] == "completed" and rows[-1]["step"] == 2
    first = next(row for row in rows if "loss" in row)
    assert abs(first["rewards/chosen"]) < 1e-6 and abs(first["rewards/rejected"]) < 1e-6, first


@pytest.mark.parametrize("stage", ["dpo", "grpo"])
def test_a_resumed_run_ends_where_the_uninterrupted_one_did(stage, color_runs, tmp_path):
    """Resumed from its step-3 checkpoint, a run trains steps 4 to 6 again exactly as it did (GRPO: the same
    answers sampled too, the random state restored)."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    common = [*TRAIN, "data.eval_fraction=0", "train.eval_on_start=false", "train.eval_strategy=no",
              "train.max_steps=6", "train.logging_steps=1", "train.save_strategy=steps", "train.save_steps=3",
              f"output_dir={run}"]
    first = train_here(f"{stage}.yaml", *common, cwd=color_runs.folder)
    assert first.returncode == 0, first.stderr[-3000:]
    before = [row for row in progress(run) if "loss" in row]
    reference = load_file(run / "final" / "adapter_model.safetensors")
    resumed = train_here(f"{stage}.yaml", *common, "--resume", str(run / "checkpoint-3"), cwd=color_runs.folder)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = [row for row in progress(run) if "loss" in row]
    assert [row["step"] for row in after] == [1, 2, 3, 4, 5, 6]
    assert [row["loss"] for row in after] == pytest.approx([row["loss"] for row in before], abs=1e-6)
    weights = load_file(run / "final" / "adapter_model.safetensors")
    assert max((weights[key] - reference[key]).abs().max().item() for key in reference) <= 1e-6


def test_dpo_on_two_processes_equals_one_process_with_the_global_batch(color_runs, tmp_path):
    from safetensors.torch import load_file

    common = [*TRAIN, f"model.adapter={color_runs.sft}", "data.eval_fraction=0", "train.eval_on_start=false",
              "train.eval_strategy=no", "train.max_steps=6", "train.logging_steps=1"]
    two = launch_cli("cpu_ddp_2proc", "dpo.yaml", *common, f"output_dir={tmp_path / 'two'}",
                     "train.per_device_train_batch_size=4", timeout=600, cwd=color_runs.folder)
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_cli("train", "dpo.yaml", *common, f"output_dir={tmp_path / 'one'}",
                  "train.per_device_train_batch_size=8", cwd=color_runs.folder)
    assert one.returncode == 0, one.stderr[-3000:]
    losses = {name: [row["loss"] for row in progress(tmp_path / name) if "loss" in row] for name in ("one", "two")}
    assert losses["one"] == pytest.approx(losses["two"], rel=1e-4)
    weights = {name: load_file(tmp_path / name / "final" / "adapter_model.safetensors") for name in ("one", "two")}
    for key, tensor in weights["one"].items():
        assert (tensor - weights["two"][key]).abs().max() < 1e-5, key


@pytest.mark.parametrize("tokenizer", ["llama", "gptoss"])
def test_preference_masks_are_exact_in_every_format(tokenizer, llama_tokenizer, gptoss_tokenizer):
    from finetune.data import formats
    from finetune.data.render import Renderer, training_template
    from finetune.data.stage_rows import RowEncoder

    tok = llama_tokenizer if tokenizer == "llama" else gptoss_tokenizer
    renderer = Renderer(tok, training_template(tok, tok.chat_template), "2024-07-26")
    answer = {"llama": "{}<|eot_id|>", "gptoss": "<|channel|>final<|message|>{}<|return|>"}[tokenizer]
    before = {"llama": "<|start_header_id|>assistant<|end_header_id|>\n\n", "gptoss": "<|start|>assistant"}[tokenizer]
    question = [{"role": "user", "content": "Pick a color."}]
    rows = {
        "preference": {"prompt": question, "chosen": "blue", "rejected": "red"},
        "implicit prompt": {"chosen": [*question, {"role": "assistant", "content": "blue"}],
                            "rejected": [*question, {"role": "assistant", "content": "red"}]},
        "messages": {"messages": question, "chosen": [{"role": "assistant", "content": "blue"}],
                     "rejected": [{"role": "assistant", "content": "red"}]},
        "sharegpt_preference": {"conversations": [{"from": "human", "value": "Pick a color."}],
                                "chosen": {"from": "gpt", "value": "blue"}, "rejected": {"from": "gpt", "value": "red"}},
        "hh": {"chosen": "\n\nHuman: Pick a color.\n\nAssistant: blue", "rejected": "\n\nHuman: Pick a color.\n\nAssistant: red"},
    }
    for name, row in rows.items():
        fmt = formats.detect_format(row, {}, preference=True)
        example = formats.normalize(row, fmt, {}, None)
        encoded = RowEncoder(renderer, "dpo")(example)
        prompt = tok.decode(encoded["prompt_ids"])
        assert prompt.endswith("Pick a color." + ("<|eot_id|>" if tokenizer == "llama" else "<|end|>") + before), name
        assert tok.decode(encoded["chosen_ids"]) == answer.format("blue"), name
        assert tok.decode(encoded["rejected_ids"]) == answer.format("red"), name
        whole = renderer.render_text(example["chosen"])
        assert whole.startswith(tok.decode(encoded["prompt_ids"] + encoded["chosen_ids"])), name

    text = formats.normalize({"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}, "preference", {}, None)
    encoded = RowEncoder(renderer, "dpo")(text)  # plain text: no template, the answer and the end-of-text token
    assert tok.decode(encoded["prompt_ids"]).endswith("Q: 2+2?\nA:")
    assert tok.decode(encoded["chosen_ids"]) == " 4" + tok.eos_token
    labelled = formats.normalize({"prompt": question, "completion": "red", "label": False}, "kto", {}, None)
    encoded = RowEncoder(renderer, "kto")(labelled)
    assert tok.decode(encoded["completion_ids"]) == answer.format("red") and encoded["label"] is False


def test_reasoning_is_part_of_each_preferred_answer(gptoss_tokenizer):
    """GPT-OSS pairs with reasoning: the analysis channel is scored with the answer it leads to. With
    data.train_thinking: false it would be prompt, a different one for each answer: refused, saying what to set."""
    from finetune.data import formats
    from finetune.data.render import Renderer, training_template
    from finetune.data.stage_rows import RowEncoder

    row = {"prompt": [{"role": "user", "content": "Pick a color."}],
           "chosen": [{"role": "assistant", "thinking": "Blue is calm.", "content": "blue"}],
           "rejected": [{"role": "assistant", "thinking": "Red is loud.", "content": "red"}]}
    example = formats.normalize(row, formats.detect_format(row, {}, preference=True), {}, None)
    template = training_template(gptoss_tokenizer, gptoss_tokenizer.chat_template)
    encoded = RowEncoder(Renderer(gptoss_tokenizer, template, "2024-07-26"), "dpo")(example)
    assert gptoss_tokenizer.decode(encoded["chosen_ids"]) == (
        "<|channel|>analysis<|message|>Blue is calm.<|end|><|start|>assistant<|channel|>final<|message|>blue<|return|>")
    assert gptoss_tokenizer.decode(encoded["prompt_ids"]).endswith("Pick a color.<|end|><|start|>assistant")
    without = RowEncoder(Renderer(gptoss_tokenizer, template, "2024-07-26", train_thinking=False), "dpo")
    with pytest.raises(formats.BadRow, match="with data.train_thinking: false the answers' reasoning"):
        without(example)


def test_hh_pairs_validate_with_their_spans(tiny_models, tmp_path, capsys):
    """1,000 real Anthropic HH pairs: multi-turn transcripts become conversations whose last answers differ. Three
    have an empty assistant turn: reported by line, and left out with data.bad_rows=drop."""
    data = asset("datasets/hh-rlhf/harmless_base_test_1000.jsonl")
    recipe = write_recipe(tmp_path, f"stage: dpo\nmodel: {{name_or_path: {tiny_models['llama']}}}\n"
                          f"data: {{train: {data}}}\ntrain: {{max_length: 512}}\n")
    code, _, err = cli_here(capsys, "validate", str(recipe))
    assert code == 2 and "3 bad data rows" in err
    assert f"{data} line 87: message 4: assistant message is empty" in err
    code, out, err = cli_here(capsys, "validate", str(recipe), "data.bad_rows=drop")
    assert code == 0, err[-3000:]
    assert "Data (stage dpo)" in out and "bad rows dropped (data.bad_rows=drop): 3" in out
    import re

    kept = int(re.search(r"\n  train: ([\d,]+) pairs", out).group(1).replace(",", ""))
    dropped = re.search(r"\n    ([\d,]+) pairs dropped", out)
    assert kept + (int(dropped.group(1)) if dropped else 0) == 997 and "pairs truncated at max_length 512" in out
    first = json.loads(data.read_text().splitlines()[0])
    chosen_answer = first["chosen"].rsplit("\n\nAssistant: ", 1)[1]
    rejected_answer = first["rejected"].rsplit("\n\nAssistant: ", 1)[1]
    assert f"⟦{chosen_answer.strip()}<|eot_id|>⟧" in out and f"⟦{rejected_answer.strip()}<|eot_id|>⟧" in out
    assert "[chosen]" in out and "[rejected]" in out


@pytest.mark.parametrize("overrides, message", [
    (["stage=dpo", "dpo.betta=0.2"], "unknown key 'dpo.betta' (not a field of TRL's DPOConfig); did you mean "
                                     "'dpo.beta'?"),
    (["dpo.beta=0.2"], "dpo settings are given but the stage is sft"),
    (["stage=dpo", "train.beta=0.2"], "train.beta is a setting of stage dpo: write it as dpo.beta"),
    (["stage=dpo", "train.packing=true"], "train.packing is SFT's (stage sft); stage dpo does not use it"),
    (["stage=dpo", "data.loss_on=all"], "stage dpo scores answers only"),
    (["stage=grpo"], "stage grpo needs grpo.rewards"),
    (["stage=grpo", "grpo.rewards=[{function: nowhere.py:score}]"], "nowhere.py does not exist"),
    (["stage=grpo", "grpo.rewards=[{function: length}]"], "(length) needs max_tokens"),
    (["stage=grpo", "grpo.rewards=[answer]", "grpo.num_generations=3"], "must be divisible by num_generations"),
    (["stage=dpo", "model.adapter=runs/none"], "model.adapter runs/none is not a LoRA adapter"),
    (["stage=sft", "data.format=hh"], "data.format hh is not data for stage sft"),
])
def test_stage_recipes_are_checked_before_anything_loads(overrides, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli_here(capsys, "validate", "quickstart", *overrides)
    assert code == 2 and message in err


def test_vllm_generation_is_refused_on_the_cpu(color_runs):
    result = train_here("grpo.yaml", *TRAIN, "grpo.use_vllm=true", "output_dir=runs/vllm", cwd=color_runs.folder)
    assert result.returncode == 2 and "grpo.use_vllm generates with vLLM, which needs a CUDA GPU" in result.stderr
    assert not (color_runs.folder / "runs" / "vllm").exists()


@pytest.mark.parametrize("installed", [None, "0.34.0"])
def test_vllm_generation_on_a_gpu_names_the_release_that_fits_this_torch(installed, tmp_path, monkeypatch):
    """On a CUDA machine without vLLM, or with a release pinned to another torch: the extra to install, by name."""
    import tomllib

    from finetune.errors import UserError
    from finetune.recipe import stage_sections
    from finetune.recipe.schema import load_recipe

    if installed:  # an installed package as pip leaves one: its import folder and its dist-info
        (tmp_path / "vllm").mkdir()
        (tmp_path / "vllm" / "__init__.py").write_text("")
        (tmp_path / f"vllm-{installed}.dist-info").mkdir()
        (tmp_path / f"vllm-{installed}.dist-info" / "METADATA").write_text(f"Name: vllm\nVersion: {installed}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
    recipe = load_recipe("llama-3.2-3b-grpo", ["grpo.use_vllm=true"])
    with pytest.raises(UserError) as refused:
        stage_sections.check_device_options(recipe, cuda=True)
    found = f"vllm {installed} is installed" if installed else "vLLM is not installed"
    assert f'needs vLLM >=0.27,<0.30 (the releases built on this toolkit\'s torch that TRL supports) and {found}: ' \
           'pip install -e ".[vllm]"' in str(refused.value)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{stage_sections.VLLM_VERSIONS}"]


def test_format_reward_sees_harmony_channels(gptoss_tokenizer):
    """GPT-OSS answers in channels: a format reward can ask for a final-channel message, which TRL's text (special
    tokens dropped) no longer shows."""
    from finetune.recipe import rewards

    checked = rewards.check([{"function": "format", "pattern": r"<\|channel\|>final<\|message\|>\S"},
                             {"function": "answer", "extract": "last-number"}], "recipe")
    format_reward, answer = rewards.build(checked, gptoss_tokenizer)
    generated = ["<|channel|>analysis<|message|>3 + 4 = 7.<|end|><|start|>assistant<|channel|>final<|message|>7"
                 "<|return|>", "<|channel|>analysis<|message|>3 + 4 is 8<|return|>"]
    ids = [gptoss_tokenizer(text, add_special_tokens=False)["input_ids"] for text in generated]
    completions = [[{"role": "assistant", "content": gptoss_tokenizer.decode(i, skip_special_tokens=True)}]
                   for i in ids]
    assert format_reward(completions, completion_ids=ids) == [1.0, 0.0]
    assert answer(completions, answer=["#### 7", "#### 7"], completion_ids=ids) == [1.0, 0.0]


def test_user_reward_function_is_loaded_and_called(tmp_path):
    from finetune.recipe import rewards

    (tmp_path / "mine.py").write_text("def shorter(completions, **_):\n"
                                      "    return [1.0 / (1 + len(c[0]['content'])) for c in completions]\n")
    checked = rewards.check([{"function": f"{tmp_path / 'mine.py'}:shorter", "weight": 0.5},
                             {"function": "answer", "extract": "gsm8k"},
                             {"function": "answer", "extract": "last-number"}], "recipe")
    shorter, answer, last_number = rewards.build(checked, tokenizer=None)
    # TRL logs each by name (rewards/<name>/mean): a second use of a name gets its own
    assert [shorter.__name__, answer.__name__, last_number.__name__] == ["shorter", "answer", "answer_2"]
    assert checked[0]["weight"] == 0.5
    completions = [[{"role": "assistant", "content": "So 3 + 4 = 7.\n#### 7"}],
                   [{"role": "assistant", "content": "#### 8"}]]
    assert shorter(completions) == [1 / 21, 1 / 7]
    assert answer(completions, answer=["3 + 4 = 7\n#### 7", "#### 7"]) == [1.0, 0.0]
    assert last_number(completions, answer=["7", "7"]) == [1.0, 0.0]


def test_stage_recipes_for_gpus_train_scaled_down(tiny_models, tmp_path):
    """The shipped DPO (QLoRA) and GRPO recipes, on two DDP processes with a random tiny Llama 3.2 and the real
    tokenizer: HH pairs and GSM8K questions."""
    ddp = launch_argv("cpu_ddp_2proc")
    small = ["model.backend=hf", "train.max_steps=2", "train.logging_steps=1", "train.save_strategy=no",
             "data.max_rows=40", f"model.name_or_path={tiny_models['llama']}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    dpo = subprocess.run([*ddp, "llama-3.2-3b-dpo-qlora", *small, f"output_dir={tmp_path / 'dpo'}",
                          f"data.train={asset('datasets/hh-rlhf/harmless_base_test_1000.jsonl')}",
                          "train.per_device_train_batch_size=1", "train.gradient_accumulation_steps=1",
                          "train.max_length=256", "train.eval_strategy=no", "data.eval_fraction=0"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert dpo.returncode == 0, dpo.stderr[-3000:]
    grpo = subprocess.run([*ddp, "llama-3.2-3b-grpo", *small, f"output_dir={tmp_path / 'grpo'}",
                           f"data.train={asset('datasets/gsm8k/train.jsonl')}", "grpo.max_completion_length=8",
                           "grpo.num_generations=4", "train.per_device_train_batch_size=4"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert grpo.returncode == 0, grpo.stderr[-3000:]
    rows = [row for row in progress(tmp_path / "dpo") if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2] and all("rewards/margins" in row for row in rows)
    rows = [row for row in progress(tmp_path / "grpo") if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    assert all("rewards/answer/mean" in row and "rewards/format/mean" in row for row in rows)


def test_panel_plots_a_stage_and_validates_the_stage_chosen(color_runs, tmp_path):
    """The Live tab plots DPO's margins and accuracies; the Train tab's stage goes into the recipe and its data is
    checked as that stage's."""
    import shutil

    from tests.test_panel import FIELDS, Panel

    workspace = tmp_path / "ws"
    shutil.copytree(color_runs.dpo, workspace / "runs" / "dpo")
    panel = Panel(workspace)
    try:
        shown = panel.client.predict("dpo", api_name="/progress")
        assert "dpo · completed" in shown[0]
        plot = shown[5]
        metric = plot["columns"].index("metric")
        assert {row[metric] for row in plot["data"]} == {"rewards/margins", "rewards/accuracies"}
        assert len(plot["data"]) == 2 * len([row for row in progress(color_runs.dpo) if "loss" in row])
        prefs = color_runs.folder / "prefs.jsonl"
        fields = ["", str(prefs), *FIELDS[2:6], "dpo", str(color_runs.sft)]  # the base: the adapter's
        checked = panel.client.predict("quickstart", "one process (finetune train)", "d1", *fields, "method=lora",
                                       api_name="/validate")
        assert checked[1] == "✓ The recipe and its data are valid." and "Data (stage dpo)" in checked[0]
        fields[6] = "grpo"
        refused = panel.client.predict("quickstart", "one process (finetune train)", "d1", *fields, "method=lora",
                                       api_name="/validate")
        assert "stage grpo needs grpo.rewards" in refused[1]
    finally:
        panel.close()
