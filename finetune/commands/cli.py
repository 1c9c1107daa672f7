"""The `finetune` command: its options and the recipe commands (train, validate, estimate, doctor); the commands on
trained models (chat, eval, export, ui) are in model_commands.py. Heavy libraries load inside the commands, so
`finetune --help` is instant."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from finetune import __version__
from finetune.commands.model_commands import chat_command, eval_command, export_command, serve_command, ui_command
from finetune.commands.plan_commands import estimate_command
from finetune.errors import UserError
from finetune.trained_model.evaluate import METRICS  # light: its heavy imports are inside its functions
from finetune.trained_model.gguf import TYPES as GGUF_TYPES
from finetune.trained_model.served_models import MAX_REQUEST_MB

RECIPE_HELP = "a recipe file, or the name of a shipped recipe (e.g. quickstart)"
OVERRIDES_HELP = ("settings over the recipe's, written key.sub=value (e.g. train.learning_rate=1e-4 lora.r=8); "
                  "a value is read as YAML (numbers, true/false, [lists], {mappings}), except for a text setting "
                  "(data.system_prompt, output_dir, ...), which takes the text as written, # and : included")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # overrides may come after options, e.g. --accelerate-config X k=v
    takes_overrides = getattr(args, "overrides", None) is not None
    unknown = [item for item in extra if item.startswith("-") or "=" not in item or not takes_overrides]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.command(args)
    except UserError as error:
        rank = os.environ.get("RANK", "0")
        if not error.every_process_alike:
            print(f"error{'' if rank == '0' else f' (process {rank})'}: {error}", file=sys.stderr, flush=True)
        elif rank == "0":  # under DDP every process fails alike: say it once
            print(f"error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C: the run folder says where it stopped
        print("stopped at once, without a checkpoint for this step", file=sys.stderr, flush=True)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune", description="Memory-efficient LLM fine-tuning: recipes in, adapters out."
    )
    parser.add_argument("--version", action="version", version=f"finetune {__version__}")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    for add in (_add_train, _add_validate, _add_prepare, _add_estimate, _add_doctor, _add_chat, _add_serve, _add_export, _add_eval,
                _add_ui):
        add(commands)
    return parser


def _recipe_command(commands, name: str, function, summary: str, description: str) -> argparse.ArgumentParser:
    command = commands.add_parser(name, help=summary, description=description)
    command.add_argument("recipe", help=RECIPE_HELP)
    command.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    command.set_defaults(command=function)
    return command


def _add_train(commands) -> None:
    train = _recipe_command(
        commands, "train", train_command,
        "train a recipe on this machine, or on several processes with --accelerate-config",
        "Train a recipe. Writes the run folder (output_dir): finetune.yaml, progress.jsonl, train.log, "
        "checkpoint-N/ and final/.",
    )
    train.add_argument(
        "--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
        help="continue the run in output_dir from its newest complete checkpoint, or from CHECKPOINT (one of its "
        "checkpoint-N folders): weights, optimizer, schedule, data position and random state as they were",
    )
    train.add_argument(
        "--accelerate-config",
        metavar="NAME",
        help="launch with `accelerate launch --config_file` on this config (a file, or a shipped name such as "
        "ddp_8gpu); the recipe and data are checked once before any process starts",
    )
    ray = train.add_argument_group("Ray Train (--engine ray; needs the ray extra)")
    ray.add_argument("--engine", choices=["accelerate", "ray"], default="accelerate",
                     help="how the training processes start (default: accelerate)")
    ray.add_argument("--num-workers", type=int, default=1, metavar="N", help="Ray workers, one process each (default: 1)")
    ray.add_argument("--gpus-per-worker", type=float, metavar="G",
                     help="GPUs per worker (default: 1 where the cluster has GPUs, else 0)")
    ray.add_argument("--address", metavar="ADDRESS",
                     help="the Ray cluster: auto (the one this machine belongs to) or ray://HOST:PORT "
                     "(default: start a local one)")
    ray.add_argument("--storage", metavar="PATH",
                     help="where Ray keeps the run's state and checkpoint records (default: ~/ray_results); "
                     "on several machines, a path they all reach, like output_dir")
    ray.add_argument("--max-failures", type=int, default=0, metavar="N",
                     help="start the workers again this many times after a worker dies, resuming from the last "
                     "checkpoint (default: 0)")


def _add_validate(commands) -> None:
    _recipe_command(
        commands, "validate", validate_command,
        "check a recipe and its data without training",
        "Check a recipe and its data, print the resolved configuration and a data report (rows, token lengths, "
        "truncation, tokens that carry loss, one rendered example).",
    )


def _add_prepare(commands) -> None:
    prepare = _recipe_command(
        commands, "prepare", prepare_command,
        "render, mask, tokenize and pack a recipe's data once, into Arrow shards that training reads",
        "Prepare a recipe's data (every format and mixture train reads) into a folder of Arrow shards, on all "
        "cores, in memory that does not grow with the data. Train from it with data.prepared=DIR; a second prepare "
        "of the same inputs does nothing.",
    )
    prepare.add_argument("--out", metavar="DIR", help="the folder (or an fsspec URL: s3://, gs://, ...) to write; "
                         "default: data.prepared, else the cache that train reads")


def _add_estimate(commands) -> None:
    estimate = _recipe_command(
        commands, "estimate", estimate_command,
        "plan a recipe before launch: memory per device (fits or not, the largest micro-batch), time and cost",
        "Count what each device holds while the recipe trains (weights, adapter and optimizer state, DDP buckets, "
        "activations, loss, CUDA context) from the model's configuration, without loading weights; compare it "
        "with the card and find the largest micro-batch that fits at the recipe's max_length. Then plan the run's "
        "time from the FLOPs of its prepared data and the card's speed (assumed, or measured with --probe), and its "
        "cost.",
    )
    where = estimate.add_mutually_exclusive_group()
    where.add_argument("--gpu", help="the card: a10, l4, a100-40, a100-80, h100, h200, or a size such as 48GB "
                       "(default: this machine's GPU; without one, this machine's CPU and memory, as --device cpu)")
    where.add_argument("--device", choices=["cpu"], help="plan for training on this machine's CPU and memory")
    estimate.add_argument("--num-gpus", type=int, help="processes (default: the accelerate config's, else 1)")
    estimate.add_argument("--accelerate-config", metavar="NAME",
                          help="the launch (DDP replicates the model on each GPU; FSDP and ZeRO-3 shard it)")
    estimate.add_argument("--probe", action="store_true",
                          help="also run two real training steps with the recipe's longest batch here, print the "
                          "measured peak beside the plan, and plan the time from their measured speed")
    estimate.add_argument("--tokens", metavar="N",
                          help="plan the time for N training tokens per epoch instead of the prepared data (e.g. 50000000 "
                          "or 5e7)")
    estimate.add_argument("--bus-gb-s", type=float, metavar="GBPS",
                          help="the all-reduce bus bandwidth between the GPUs, as `finetune doctor --ddp` measured it "
                          "on them (default: the card's link figure)")
    estimate.add_argument("--price-per-gpu-hour", type=float, metavar="USD", help="what one GPU costs per hour")
    estimate.add_argument("--prices", metavar="FILE",
                          help="a YAML file of prices per GPU-hour by card (a10: 1.10, h100: 3.50, ...)")
    estimate.add_argument("--compare", metavar="LAUNCHES",
                          help="one row per launch, CARDxCOUNT comma-separated (e.g. a10x8,h100x8,h200x1): fits, "
                          "micro-batch, step time, tokens/s, run time and cost")


def _add_doctor(commands) -> None:
    doctor = commands.add_parser(
        "doctor", help="check what runs depend on here: versions, GPUs, disk, Hub token; --ddp: a DDP health check",
        description="Report torch, CUDA and NCCL versions, GPUs with memory and bf16 support, Unsloth, bitsandbytes, "
        "FlashAttention, Liger and DeepSpeed, whether the installed versions agree with the pins, free disk at the "
        "output folder and caches, and whether a Hub token is configured.",
    )
    doctor.add_argument("--ddp", nargs="?", type=int, const=0, metavar="N",
                        help="also train a small network with plain PyTorch DDP on N processes (default: every GPU, "
                        "or two CPU processes), checking that all ranks agree, and time an all-reduce")
    doctor.add_argument("--output-dir", default="runs",
                        help="where runs will be written, for its free disk (default: runs)")
    doctor.set_defaults(command=doctor_command)


def _add_chat(commands) -> None:
    chat = commands.add_parser(
        "chat", help="chat with a trained model (a run's final/, a checkpoint-N/ or an export)",
        description="Chat with a trained model, with the chat template used in training. Interactive, with history "
        "(/reset clears it, /exit or Ctrl-D quits), or one answer with --prompt.",
    )
    chat.add_argument("path", help="a run's final/ (or the run folder), a checkpoint-N/, or a `finetune export` folder")
    chat.add_argument("--prompt", help="answer this one message, print only the answer, and exit")
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument("--base-model", help="where the adapter's base model is, if not where the recipe says")
    chat.add_argument("--max-new-tokens", type=int, default=512, help="the longest answer, in tokens (default: 512)")
    chat.add_argument("--temperature", type=float, default=0.7, help="0 for greedy decoding (default: 0.7)")
    chat.add_argument("--top-p", type=float, default=0.95,
                      help="sample from the smallest set of tokens whose probability reaches this (default: 0.95)")
    chat.add_argument("--seed", type=int, help="a seed for sampling, for answers that repeat")
    chat.set_defaults(command=chat_command)


def _add_export(commands) -> None:
    export = commands.add_parser(
        "export", help="export an adapter or a merged model, checked, optionally pushed to the Hub",
        description="Write the adapter (PEFT, safetensors) or, with --merge, the model with the adapter merged into "
        "its 16-bit base, with the tokenizer, chat template, generation config and a model card. The export is "
        "reloaded and its logits compared with the trained model's before it is kept.",
    )
    export.add_argument("path", nargs="?", help="a run's final/ (or the run folder), or a checkpoint-N/")
    export.add_argument("--out", help="the folder to write (must not exist, or be empty)")
    export.add_argument("--check", metavar="TARGET",
                        help="write nothing: compare the prompts of every place TARGET's chat template lives (training, "
                        "chat, serve, the vLLM template file, its GGUF and Modelfile); exit 1 on a difference")
    export.add_argument("--merge", action="store_true", help="merge the adapter into its base (16-bit, never 4-bit)")
    export.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                        help="weights of a merged or fully fine-tuned model (default: bf16)")
    export.add_argument("--base-model", help="where the adapter's base model is, if not where the recipe says")
    export.add_argument("--push-to-hub", metavar="REPO", help="upload the export to this Hub repository")
    export.add_argument("--private", action="store_true", help="create the Hub repository private")
    export.add_argument("--gguf", action="store_true",
                        help="also write a GGUF, checked by llama.cpp (the gguf extra): of the merged model with "
                        "--merge, else the adapter as a GGUF adapter")
    export.add_argument("--gguf-type", choices=GGUF_TYPES,
                        help="the GGUF's weights (default: --dtype's: bf16, f16 or f32; an adapter: not q4_k_m); "
                        "implies --gguf")
    export.add_argument("--license", help="the card's license id (default: the base model's, when known)")
    export.add_argument("--register", metavar="NAME",
                        help="register the export as a new version of NAME in the MLflow model registry (the "
                        "store the run was tracked in, else MLFLOW_TRACKING_URI, else mlflow.db in the workspace)")
    export.set_defaults(command=export_command)


def _add_eval(commands) -> None:
    evaluate = commands.add_parser(
        "eval", help="evaluate trained models side by side: loss, generated answers and their metrics",
        description="For each TARGET: loss and perplexity on --data with the template and masks of training, greedy "
        "answers to its prompts (batched), exact match, contains, ROUGE-L, BLEU, stop rate and mean length; "
        "optionally lm-evaluation-harness tasks. Prints a table of the targets side by side; keeps the results and "
        "answers in each target's run folder (eval/) and in --out.",
    )
    evaluate.add_argument("targets", nargs="*", metavar="TARGET",
                          help="a run (its final/), a checkpoint-N/, an export, or base:RUN for the model a run "
                          "started from")
    evaluate.add_argument("--server", metavar="URL", help="evaluate models an OpenAI-compatible endpoint serves "
                          "instead (`finetune serve`, vLLM, a provider): its answers to --data, with the same metrics "
                          "and stop rate")
    evaluate.add_argument("--model", action="append", default=[], metavar="NAME",
                          help="with --server: a model it serves; repeat for more")
    evaluate.add_argument("--api-key", help="with --server: its bearer token (or $OPENAI_API_KEY)")
    evaluate.add_argument("--data", metavar="FILE", help="examples in any format training reads: the prompt is what "
                          "comes before the last assistant turn, which is the reference answer")
    evaluate.add_argument("--metric", action="append", choices=METRICS, metavar="NAME",
                          help=f"one of {', '.join(METRICS)}; repeat for more (default: exact_match and "
                          "contains; loss, perplexity, stop_rate and mean_length are always reported)")
    evaluate.add_argument("--extract", default="none", metavar="HOW",
                          help="what exact match compares: none (the whole answer), gsm8k (the number after ####), "
                          "last-number, or regex:PATTERN (its first group) (default: none)")
    evaluate.add_argument("--max-new-tokens", type=int, default=256,
                          help="the longest answer generated, in tokens (default: 256)")
    evaluate.add_argument("--batch-size", type=int, default=16, help="prompts generated together (default: 16)")
    evaluate.add_argument("--limit", type=int, help="the first N examples only")
    evaluate.add_argument("--format", help="the data's format, if not the recipe's (messages, alpaca, sharegpt, "
                          "prompt_completion, text)")
    evaluate.add_argument("--columns", nargs="+", metavar="FIELD=COLUMN", default=[],
                          help="map format fields to the data's columns, e.g. instruction=question output=answer")
    evaluate.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated (e.g. finetune_greetings)")
    evaluate.add_argument("--include-tasks", action="append", default=[], metavar="DIR",
                          help="a folder of lm-evaluation-harness task YAML files")
    evaluate.add_argument("--out", help="also write each target's results and answers here")
    evaluate.set_defaults(command=eval_command)


def _add_serve(commands) -> None:
    serve = commands.add_parser(
        "serve", help="answer an OpenAI-compatible API with trained models (runs, checkpoints, exports)",
        description="Serve trained models over an OpenAI-compatible API (POST /v1/chat/completions, GET /v1/models, "
        "GET /health), rendering requests with each model's training chat template. Targets trained on one base "
        "model share it: it loads once.",
    )
    serve.add_argument("targets", nargs="+", metavar="[NAME=]TARGET",
                       help="a run (its final/), a checkpoint-N/, a `finetune export` folder, or base:RUN (the model "
                       "the run started from); served as NAME, else the run's or folder's name")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on (default: 8000)")
    serve.add_argument("--api-key", help="require this bearer token (needed beyond 127.0.0.1; or $FINETUNE_API_KEY)")
    serve.add_argument("--max-request-mb", type=float, default=MAX_REQUEST_MB, metavar="MB",
                       help=f"refuse request bodies over this many MiB with 413 (default: {MAX_REQUEST_MB})")
    serve.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                       help="transformers (any machine; batches concurrent requests) or vllm (a CUDA GPU with the "
                       "vllm extra; hands the targets to vLLM's own server) (default: transformers)")
    serve.set_defaults(command=serve_command)


def _add_ui(commands) -> None:
    ui = commands.add_parser(
        "ui", help="start the web panel (launch runs, watch them, chat, export)",
        description="Start the Gradio panel on http://127.0.0.1:PORT. Runs it launches keep going when it closes.",
    )
    ui.add_argument("--workspace", default=".", help="the folder for recipes/, runs/ and exports/ (default: here)")
    ui.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    ui.add_argument("--port", type=int, default=7860, help="the port to listen on (default: 7860)")
    ui.add_argument("--share", action="store_true", help="also open a public Gradio share link (needs --auth)")
    ui.add_argument("--auth", metavar="USER:PASSWORD", help="require this login (needed beyond 127.0.0.1)")
    ui.set_defaults(command=ui_command)


def doctor_command(args) -> int:
    from finetune.commands import doctor

    print(doctor.report(args.output_dir), flush=True)
    if args.ddp is not None:
        if args.ddp < 0 or args.ddp == 1:
            raise UserError("--ddp N: N is the number of processes, at least 2 (or leave it out)")
        print("\nDDP health check ...", flush=True)
        print(doctor.ddp_check(args.ddp or None))
    return 0


def validate_command(args) -> int:
    recipe, report = _check(args.recipe, args.overrides, validating=True)
    from finetune.data.report import describe_data

    print(f"Recipe (resolved)\n{_indent(recipe.to_yaml())}")
    print(describe_data(report))
    print("OK: the recipe and its data are valid.")
    return 0


def prepare_command(args) -> int:
    from finetune.data.pipeline import prepare_into
    from finetune.data.prepared_folder import read_report
    from finetune.models.loading import load_tokenizer
    from finetune.recipe.schema import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    tokenizer = load_tokenizer(recipe)
    folder, where, made = prepare_into(recipe, tokenizer, tokenizer.chat_template, args.out or recipe.data.prepared)
    report = read_report(folder)  # the rows are not read: `prepare` of a large corpus ends when they are written
    rows = report["rows"]
    tokens = report["train"]["tokens"] + (report["eval"]["tokens"] if rows["eval"] else 0)
    done = "prepared" if made else "already prepared from the same inputs, nothing to do"
    print(f"{where}: {done}: {rows['train']:,} train rows, {rows['eval']:,} eval rows, {tokens:,} tokens", flush=True)
    if args.out and not recipe.data.prepared:
        print("train from it with: " + shlex.join(["finetune", "train", args.recipe, *args.overrides,
                                                   f"data.prepared={where}"]), flush=True)
    return 0


def train_command(args) -> int:
    resume = _resume(args)
    if args.engine == "ray":
        return _train_with_ray(args, resume)
    if args.num_workers != 1 or args.gpus_per_worker is not None or args.address or args.storage:
        raise UserError("--num-workers, --gpus-per-worker, --address and --storage are for --engine ray")
    if not args.accelerate_config:
        from finetune.models import backends
        from finetune.recipe.schema import load_recipe

        backends.import_first(args.recipe, args.overrides)
        load_recipe(args.recipe, args.overrides)  # a recipe's own faults, said before the trainer's libraries load
        from finetune.training.run import run

        run(args.recipe, args.overrides, resume)
        return 0
    from finetune.recipe.yaml_files import accelerate_settings
    from finetune.resources import find_accelerate_config
    from finetune.training import launcher

    config = find_accelerate_config(args.accelerate_config)
    recipe, _ = _check(args.recipe, args.overrides, resume, accelerate_settings(config))  # leaves the data cached
    resume_arguments = [] if not resume else ["--resume"] if resume is True else ["--resume", resume]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "-m", "finetune.train", args.recipe, *args.overrides, *resume_arguments]
    print("launching:", " ".join(command[2:]), flush=True)
    return launcher.supervise(command, recipe.output_dir)


def _train_with_ray(args, resume) -> int:
    from finetune.training import ray_engine

    if args.accelerate_config:
        raise UserError("--engine ray starts its own workers: leave out --accelerate-config")
    if args.num_workers < 1 or (args.gpus_per_worker or 0) < 0 or args.max_failures < -1:
        raise UserError("--num-workers must be at least 1, --gpus-per-worker at least 0, --max-failures at least -1 "
                        "(-1: no limit)")
    gpus = args.gpus_per_worker
    launch = {"num_processes": args.num_workers, "distributed_type": "MULTI_GPU", "use_cpu": gpus == 0}
    recipe, _ = _check(args.recipe, args.overrides, resume, launch)
    return ray_engine.launch(args.recipe, args.overrides, resume, recipe.output_dir, args.num_workers, gpus,
                             args.address, args.storage and os.path.abspath(args.storage), args.max_failures)


def _resume(args) -> bool | str:
    """--resume as given; `--resume key=value` is --resume followed by an override. Resuming from a checkpoint
    folder means its run folder, unless output_dir is given too."""
    resume = args.resume
    if isinstance(resume, str) and "=" in resume and not os.path.exists(resume):
        args.overrides.append(resume)
        resume = True
    if isinstance(resume, str) and not any(item.startswith("output_dir=") for item in args.overrides):
        args.overrides.append(f"output_dir={os.path.dirname(os.path.normpath(resume))}")
    return resume


def _check(recipe_path: str, overrides: list[str], resume: bool | str = False, launch: dict | None = None,
           validating: bool = False):
    """Everything `train` checks before loading weights (training/preflight.py), for the processes `launch` (an
    accelerate config read as a mapping) starts. Returns the recipe and the data report."""
    from finetune.recipe.schema import load_recipe
    from finetune.training import preflight

    recipe = load_recipe(recipe_path, overrides)
    checked = preflight.check(recipe, preflight.Launch.of(launch), resume, validating, say=print)
    if validating:
        for note in checked.notes:
            print(f"note: {note}", flush=True)
    return recipe, checked.data.report


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.rstrip().splitlines())


if __name__ == "__main__":
    sys.exit(main())
