"""The `finetune` command. Heavy libraries load inside the commands, so `finetune --help` is instant."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from finetune.errors import UserError

RECIPE_HELP = "a recipe file, or the name of a shipped recipe (e.g. quickstart)"
OVERRIDES_HELP = "settings over the recipe's, written key.sub=value (e.g. train.learning_rate=1e-4 lora.r=8)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # overrides may come after options, e.g. --accelerate-config X k=v
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.command(args)
    except UserError as error:
        if os.environ.get("RANK", "0") == "0":  # under DDP every process fails alike: say it once
            print(f"error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C: the run folder says where it stopped
        print("stopped at once, without a checkpoint for this step", file=sys.stderr, flush=True)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune", description="Memory-efficient LLM fine-tuning: recipes in, adapters out."
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    def recipe_command(name: str, function, summary: str, description: str) -> argparse.ArgumentParser:
        command = commands.add_parser(name, help=summary, description=description)
        command.add_argument("recipe", help=RECIPE_HELP)
        command.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
        command.set_defaults(command=function)
        return command

    train = recipe_command(
        "train", train_command,
        "train a recipe on this machine, or on several processes with --accelerate-config",
        "Train a recipe. Writes the run folder (output_dir): finetune.yaml, progress.jsonl, train.log, "
        "checkpoint-N/ and final/.",
    )
    train.add_argument(
        "--accelerate-config",
        metavar="NAME",
        help="launch with `accelerate launch --config_file` on this config (a file, or a shipped name such as "
        "ddp_8gpu); the recipe and data are checked once before any process starts",
    )
    recipe_command(
        "validate", validate_command,
        "check a recipe and its data without training",
        "Check a recipe and its data, print the resolved configuration and a data report (rows, token lengths, "
        "truncation, tokens that carry loss, one rendered example).",
    )
    return parser


def validate_command(args) -> int:
    recipe, report = _check(args.recipe, args.overrides)
    from finetune.report import describe_data

    print(f"Recipe (resolved)\n{_indent(recipe.to_yaml())}")
    print(describe_data(report))
    print("OK: the recipe and its data are valid.")
    return 0


def train_command(args) -> int:
    if not args.accelerate_config:
        from finetune import backends

        backends.import_first(args.recipe, args.overrides)
        from finetune.run import run

        run(args.recipe, args.overrides)
        return 0
    from finetune.resources import find_accelerate_config

    config = find_accelerate_config(args.accelerate_config)
    _check(args.recipe, args.overrides)  # also leaves the prepared data in the cache for every process
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "-m", "finetune.train", args.recipe, *args.overrides]
    print("launching:", " ".join(command[2:]), flush=True)
    process = subprocess.Popen(command)
    # A stop request (SIGTERM, or Ctrl-C, which the terminal also sends to the launcher) passes to the launcher,
    # whose processes then stop at the end of a step with a checkpoint; this process waits for them.
    signal.signal(signal.SIGTERM, lambda signum, frame: process.send_signal(signal.SIGTERM))
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:
            continue


def _check(recipe_path: str, overrides: list[str]):
    """Everything `train` checks before loading weights: recipe, backend, output_dir, tokenizer, data."""
    from finetune import backends
    from finetune.config import load_recipe
    from finetune.data.pipeline import prepare
    from finetune.model import load_tokenizer
    from finetune.run_folder import check_free

    recipe = load_recipe(recipe_path, overrides)
    print(backends.resolve(recipe.model.backend)[1], flush=True)
    check_free(recipe.output_dir)
    tokenizer = load_tokenizer(recipe)
    return recipe, prepare(recipe, tokenizer, tokenizer.chat_template).report


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.rstrip().splitlines())


if __name__ == "__main__":
    sys.exit(main())
