"""The command line as a user meets it: help, validate, and errors (one message, exit 2, nothing written)."""

from __future__ import annotations

import pytest

from tests.conftest import cli_here, run_cli, write_recipe


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["validate", "--help"], ["chat", "--help"],
                                  ["export", "--help"]])
def test_help(args):
    result = run_cli(*args)
    assert result.returncode == 0 and "usage: finetune" in result.stdout and not result.stderr


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"finetune {version('finetune')}"


def test_training_module_help_is_the_train_command():
    result = run_cli("--help", module="finetune.train")
    assert result.returncode == 0 and "usage: finetune train" in result.stdout


def test_validate_prints_config_and_data_report(tmp_path):
    result = run_cli("validate", "quickstart", f"output_dir={tmp_path / 'run'}", "train.max_length=128")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Recipe (resolved)" in out and "name_or_path: builtin:tiny-llama" in out and "max_length: 128" in out
    assert "train: 5,880 rows" in out and "eval: 120 rows" in out and "of tokens carry loss" in out
    assert "tokens per row: p50" in out and "rows truncated at max_length 128" in out and "packed into" in out
    example = out.split("Example (tokens that carry loss are between ⟦ and ⟧):")[1]
    assert "<|im_start|>user\n" in example and "<|im_start|>assistant\n  ⟦" in example and "<|im_end|>⟧" in example
    assert "⟦<|im_start|>" not in example  # prompts never carry loss
    assert out.rstrip().endswith("OK: the recipe and its data are valid.")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        ("model: {name_or_path: builtin:tiny-llama}\ndata: {train: builtin:greetings}\nlora: {rnak: 8}\n", [],
         "unknown key 'lora.rnak'; did you mean 'lora.r'?"),
        ("model: {name_or_path: builtin:tiny-llama}\ndata: {train: builtin:greetings}\n", ["train.num_train_epochs=x"],
         "train.num_train_epochs must be a number"),
        ("model: {name_or_path: builtin:tiny-llama}\ndata: {train: builtin:greetings}\nmethod: full\nlora: {r: 8}\n",
         [], "method is full"),
        ("model: {name_or_path: ./no/such/model}\ndata: {train: builtin:greetings}\n", [],
         "model.name_or_path: ./no/such/model does not exist (no such folder; relative paths start from"),
        ("model: {name_or_path: builtin:tiny-llama}\ndata: {train: missing.jsonl}\n", [], "does not exist"),
    ],
)
def test_bad_input_is_one_message_exit_2_and_no_run_folder(tmp_path, recipe, overrides, message, capsys,
                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_recipe(tmp_path, recipe)
    code, _, err = cli_here(capsys, "train", str(path), f"output_dir={tmp_path / 'run'}", *overrides)
    assert code == 2
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_validate_reports_bad_input_the_same_way(tmp_path, capsys):
    path = write_recipe(tmp_path, "model: {name_or_path: builtin:tiny-llama}\ndata: {train: builtin:greetings}\n")
    code, _, err = cli_here(capsys, "validate", str(path), "lora.rnak=8")
    assert code == 2 and err == "error: override 'lora.rnak=8': unknown key 'lora.rnak'; did you mean 'lora.r'?\n"


def test_an_existing_run_is_refused_by_train_and_reported_by_validate(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "progress.jsonl").write_text('{"step": 10, "loss": 1.0}\n{"status": "completed", "step": 10}\n')
    code, _, err = cli_here(capsys, "train", "quickstart", f"output_dir={tmp_path / 'run'}")
    assert code == 2 and "already exists and is not empty: continue that run with --resume" in err
    code, out, err = cli_here(capsys, "validate", "quickstart", f"output_dir={tmp_path / 'run'}", "train.max_length=128")
    assert code == 0, err
    assert f"note: output_dir {tmp_path / 'run'} holds a run already; `finetune train` continues it with --resume" \
        in out and "OK: the recipe and its data are valid." in out


def test_unknown_accelerate_config(tmp_path, capsys):
    code, _, err = cli_here(capsys, "train", "quickstart", "--accelerate-config", "ddp_9gpu",
                            f"output_dir={tmp_path / 'run'}")
    assert code == 2 and "accelerate config 'ddp_9gpu' not found" in err
    assert "cpu_ddp_2proc, ddp_8gpu, ddp_8xa10, ddp_8xh100, deepspeed_zero3_8gpu" in err


def test_options_and_overrides_go_where_they_belong(tmp_path):
    result = run_cli("chat", str(tmp_path), "lora.r=8")
    assert result.returncode == 2 and "unrecognized arguments: lora.r=8" in result.stderr
    result = run_cli("export", str(tmp_path), "--out", str(tmp_path / "out"), "--private")
    assert result.returncode == 2 and "--private applies to --push-to-hub" in result.stderr


def test_every_option_says_what_it_does_and_its_default():
    import argparse

    from finetune.commands.cli import build_parser

    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    missing = []
    for name, command in commands.choices.items():
        for action in command._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
                continue
            has_default = action.default not in (None, False, [], argparse.SUPPRESS) and action.const is None
            if not action.help or (has_default and "default" not in action.help):
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, f"options without help or without their default: {missing}"
