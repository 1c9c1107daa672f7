"""The memory plan: exact parameter counts, the shipped recipes' verdicts on their hardware, the launch it follows,
the `auto` micro-batch that keeps the global batch, and the probe beside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from finetune.errors import UserError
from finetune.models.architectures import (gemma2_2b, gemma3_1b, gemma3_4b, gpt_oss_20b, llama_3_2_3b, mistral_7b,
                                           phi3_mini, qwen2_5_1_5b, qwen3_4b)
from finetune.plan import devices, memory_plan, shapes
from finetune.recipe.schema import load_recipe
from tests.conftest import cli_here, run_cli, train_here, write_recipe

HUB_MODELS = {
    "unsloth/Llama-3.2-3B-Instruct": llama_3_2_3b,
    "meta-llama/Llama-3.2-3B-Instruct": llama_3_2_3b,
    "openai/gpt-oss-20b": gpt_oss_20b,
    "unsloth/gpt-oss-20b-unsloth-bnb-4bit": gpt_oss_20b,
}
FAMILY_MODELS = {
    "Qwen/Qwen2.5-1.5B-Instruct": qwen2_5_1_5b, "Qwen/Qwen3-4B-Instruct-2507": qwen3_4b,
    "google/gemma-2-2b-it": gemma2_2b, "google/gemma-3-1b-it": gemma3_1b,
    "mistralai/Mistral-7B-Instruct-v0.3": mistral_7b, "microsoft/Phi-3-mini-4k-instruct": phi3_mini,
}
HUB_MODELS.update(FAMILY_MODELS, **{"Qwen/Qwen3-4B": qwen3_4b, "google/gemma-3-4b-it": gemma3_4b})


@pytest.fixture(scope="module")
def hub_configs(tmp_path_factory) -> Path:
    """A Hugging Face cache holding only the configs of the shipped recipes' models, as `hf download` leaves them."""
    root = tmp_path_factory.mktemp("hub-cache")
    commit = "0" * 40
    for repo, make_config in HUB_MODELS.items():
        folder = root / f"models--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(commit)
        make_config().save_pretrained(folder / "snapshots" / commit)
    return root


@pytest.fixture
def hub_cache(hub_configs, monkeypatch) -> Path:
    """That cache, offline, for the commands a test runs in this process: the environment and the values the Hugging
    Face libraries read from it when imported (restored after the test)."""
    import sys

    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_configs))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_configs))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    if "datasets.config" in sys.modules:
        monkeypatch.setattr(sys.modules["datasets.config"], "HF_HUB_OFFLINE", True)
    return hub_configs


def estimate(capsys, *args: str) -> str:
    code, out, err = cli_here(capsys, "estimate", *args)
    assert code == 0, err[-3000:]
    return out


def recipe_for(tmp_path, *overrides: str):
    path = write_recipe(tmp_path, "model: {name_or_path: some/model}\ndata: {train: data.jsonl}\n")
    return load_recipe(path, list(overrides))


def test_parameter_counts_are_exact_from_the_config(tmp_path):
    llama = shapes.model_shape(llama_3_2_3b(), recipe_for(tmp_path, "method=qlora"))
    assert llama.parameters == 3_212_749_824
    assert llama.adapter == 24_313_856  # r 16 on every linear layer: what PEFT trains
    assert llama.head == 0  # tied to the embedding
    gpt_oss = shapes.model_shape(gpt_oss_20b(), recipe_for(tmp_path, "method=full"))
    assert gpt_oss.parameters == 20_914_757_184
    assert gpt_oss.experts == 24 * 32 * (2880 * 5760 + 2880 * 2880)


def test_on_the_cpu_the_plan_counts_the_loading_peak_and_what_the_heap_keeps(tmp_path):
    """The Llama-3.2-1B shape saved in bf16, as benchmarks/memory.py measures it: on the CPU the process's peak is
    while loading (the fp32 weights built beside the mapped bf16 file), and QLoRA's dequantized weights stay
    resident only below the mmap threshold a CPU run sets (4 MiB: the 2048 x 512 k and v projections, at 4 MiB,
    are handed back too; a narrower model's stay)."""
    config = llama_3_2_3b(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, head_dim=64,
                          dtype="bfloat16")
    cpu, alone = devices.this_machine(cpu=True), memory_plan.launch_of(None, 1)
    overrides = ["train.bf16=false", "train.max_length=512", "train.per_device_train_batch_size=1"]
    lora = recipe_for(tmp_path, "method=lora", *overrides)
    shape = shapes.model_shape(config, lora)
    assert shape.parameters == 1_235_814_400 and shape.saved == 2 * shape.parameters
    plan = memory_plan.plan(lora, shape, cpu, alone, 1)
    process = next(line.fixed for line in plan.lines if line.what == "process")
    assert plan.loading == shape.parameters * (4 + 2) + process
    assert plan.measurable() == plan.loading > plan.total()
    assert memory_plan.plan(lora, shape, devices.device_named("a10"), alone, 1).loading == 0
    # bf16 weights from a bf16 checkpoint are its mapped pages: nothing is built beside them
    in_bf16 = recipe_for(tmp_path, "method=lora", "train.bf16=true", *overrides[1:])
    assert memory_plan.plan(in_bf16, shape, cpu, alone, 1).loading == shape.parameters * 2 + process
    qlora = recipe_for(tmp_path, "method=qlora", *overrides)
    plan = memory_plan.plan(qlora, shapes.model_shape(config, qlora), cpu, alone, 1)
    dequantized = next(line for line in plan.lines if line.what == "4-bit dequantization")
    assert dequantized.fixed == 0
    narrow = llama_3_2_3b(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=64, dtype="bfloat16")
    plan = memory_plan.plan(qlora, shapes.model_shape(narrow, qlora), cpu, alone, 1)
    dequantized = next(line for line in plan.lines if line.what == "4-bit dequantization")
    assert dequantized.fixed == 8 * (2 * 512 * 512 + 2 * 256 * 512 + 3 * 512 * 1536) * 4  # every one under 4 MiB


def test_shipped_recipes_on_their_hardware(hub_cache, capsys):
    qlora = estimate(capsys, "llama-3.2-3b-unsloth-qlora", "--gpu", "a10", "--accelerate-config", "ddp_8xa10")
    assert "NVIDIA A10 24 GB, DDP on 8 processes" in qlora and ": fits" in qlora
    assert "2.82B in NF4" in qlora and "DDP gradient buckets" in qlora
    # the counts a user checks against the model card, as PEFT's print_trainable_parameters gives them
    assert "Parameters: the model 3,212,749,824; trainable params: 24,313,856 || all params: 3,237,063,680 || " \
           "trainable%: 0.7511" in qlora, qlora

    on_a10 = estimate(capsys, "gpt-oss-20b-lora", "--gpu", "a10", "--accelerate-config", "ddp_8xa10")
    assert ": does not fit" in on_a10 and "Not even one row of 2048 tokens fits: shard the model" in on_a10
    on_h100 = estimate(capsys, "gpt-oss-20b-lora", "--gpu", "h100", "--accelerate-config", "ddp_8xh100")
    assert ": fits" in on_h100 and "eager attention" in on_h100 and "MXFP4 experts dequantized" in on_h100

    # the docs' comparison: one row per launch, the cost from the user's prices
    prices = str(hub_cache.parent / "prices.yaml")
    Path(prices).write_text("a10: 1.10\nh100: 3.50\nh200: 4.00\n")
    from tests.test_readme import PAGES

    command = next(line for line in PAGES.splitlines()
                   if line.startswith("finetune estimate") and "--compare " in line)
    compared = estimate(capsys, *command.split()[2:-1], prices)
    rows = {line.split()[0]: line.split() for line in compared.splitlines()
            if line.split()[:1] in (["a10x8"], ["h100x8"], ["h200x1"])}
    assert len(rows) == 3 and all(row[1] == "yes" and row[-1].startswith("$") for row in rows.values())

    # FSDP shards the bf16 weights over the 8 cards, and then the 20B model fits on A10s
    sharded = estimate(capsys, "gpt-oss-20b-lora", "--gpu", "a10", "--accelerate-config", "fsdp2_8gpu")
    assert "FSDP on 8 processes" in sharded and ": fits" in sharded and "gathered layer" in sharded


def test_plan_follows_the_recipe(tmp_path):
    shape_of = {}

    def total(*overrides, device="h100", processes=1, sharded=False):
        recipe = recipe_for(tmp_path, "train.max_length=4096", *overrides)
        key = (recipe.method, recipe.model.backend)
        shape_of.setdefault(key, shapes.model_shape(gpt_oss_20b(), recipe))
        launch = memory_plan.Launch(processes, sharded, "test")
        return memory_plan.plan(recipe, shape_of[key], devices.device_named(device), launch, 1).total()

    plain = total()
    assert total("train.gradient_checkpointing=false") > plain + 20 * devices.GIB  # eager scores of 24 layers
    assert total("train.optim=adamw_8bit") < plain
    assert total(processes=8) > plain  # DDP's gradient buckets
    assert total(processes=8, sharded=True) < plain - 30 * devices.GIB  # 7/8 of 39 GiB of weights
    assert total("model.attn_implementation=flash_attention_2") < plain
    assert total("train.loss_type=nll") > plain  # 4096 x 201088 logits, 10 bytes each: above the backward's


@pytest.mark.parametrize("make_config", [gpt_oss_20b, gemma3_1b, gemma3_4b])
def test_what_unsloth_cannot_run_in_float16_is_planned_as_it_trains_it_in_float32(make_config, tmp_path):
    """Asked for fp16, Unsloth trains GPT-OSS and Gemma 3 without mixed precision (it cannot run them in float16): the
    activations of an fp32 run. In bf16, which every GPU here has, it trains them in bf16; others train in fp16."""
    def activations(*overrides, config=make_config()):
        recipe = recipe_for(tmp_path, "method=qlora", "model.backend=unsloth", "train.max_length=2048", *overrides)
        planned = memory_plan.plan(recipe, shapes.model_shape(config, recipe),
                                   devices.device_named("a10"), memory_plan.Launch(1, False, "test"), 1)
        return next(line for line in planned.lines if line.what == "activations").per_row

    bf16, fp32 = activations(), activations("train.bf16=false", "train.fp16=false")
    assert activations("train.bf16=false", "train.fp16=true") == fp32 == activations("model.dtype=float16")
    assert fp32 > 1.8 * bf16 and activations("train.bf16=true") == bf16
    assert activations("train.bf16=false", "train.fp16=true", config=qwen3_4b()) == \
        activations(config=qwen3_4b())  # Qwen 3 trains in fp16 as asked


def test_auto_micro_batch_keeps_the_global_batch(tmp_path):
    recipe = recipe_for(tmp_path, "train.per_device_train_batch_size=auto", "train.global_batch_size=16",
                        "train.max_length=2048", "method=qlora")
    shape = shapes.model_shape(llama_3_2_3b(), recipe)
    launch = memory_plan.Launch(2, False, "DDP on 2 processes")
    card = devices.device_named("a10")
    fits = memory_plan.plan(recipe, shape, card, launch, 1).largest_micro_batch
    assert fits >= 8
    assert memory_plan.micro_batch_of(recipe, card, launch, shape) == 8  # all 8 rows a process takes, at once
    # a card where 3 rows fit: 3 does not divide the 8 rows per process, so 2 rows x 4 accumulation steps
    three = memory_plan.plan(recipe, shape, card, launch, 3).total() + 1
    small = devices.Device("a small card", int(three), cuda=True)
    assert memory_plan.plan(recipe, shape, small, launch, 1).largest_micro_batch == 3
    micro = memory_plan.micro_batch_of(recipe, small, launch, shape)
    assert (micro, recipe.batch_split(2, micro)) == (2, (2, 4))
    assert micro * recipe.batch_split(2, micro)[1] * 2 == 16
    tiny = devices.Device("a tiny card", 4 * devices.GIB, cuda=True)
    with pytest.raises(UserError, match="not one row of 2048 tokens fits on a tiny card"):
        memory_plan.micro_batch_of(recipe, tiny, launch, shape)


def test_training_with_auto_micro_batch(tmp_path):
    result = train_here("quickstart", f"output_dir={tmp_path / 'run'}", "train.per_device_train_batch_size=auto",
                     "train.global_batch_size=8", "train.max_steps=2", "train.save_strategy=no")
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("micro-batch auto:"))
    assert line.endswith("= global batch 8") and "8 rows of 256 tokens per process" in line


def test_a_hub_model_whose_config_is_not_here(hub_cache, capsys):
    code, _, err = cli_here(capsys, "estimate", "quickstart", "model.name_or_path=nobody/not-downloaded", "--gpu",
                            "a10")
    assert code == 2 and "Traceback" not in err
    assert "'nobody/not-downloaded' is not a local folder, it is not in the local Hugging Face cache" in err


def test_probe_measures_beside_the_plan():
    """Without --gpu on a machine without one, the plan is for its CPU, as the help says."""
    result = run_cli("estimate", "quickstart", "--probe")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("No CUDA GPU here: the plan is for this machine's CPU and memory")
    probe = next(line for line in result.stdout.splitlines() if line.startswith("Probe: peak resident memory "))
    assert re.fullmatch(r"Probe: peak resident memory [\d.]+ MiB \(planned [\d.]+ MiB, [+-][\d.]+% off\) while "
                        r"loading, [\d.]+ MiB \(planned [\d.]+ MiB, [+-][\d.]+% off\) in the steps", probe), probe
    assert "  while loading " in result.stdout
    assert "speed             measured: " in result.stdout and "--probe: " in result.stdout  # the time plan follows it
    # counts in units that fit a small model; the probe's scratch run says nothing of its own
    assert "624.5K parameters, fp32" in result.stdout and "0.00B" not in result.stdout
    assert "completed:" not in result.stdout and "finetune-probe-" not in result.stdout


@pytest.mark.parametrize("name", ["llama-3.2-3b-unsloth-qlora", "llama-3.2-3b-lora", "gpt-oss-20b-lora",
                                  "gpt-oss-20b-unsloth-qlora", "llama-3.2-3b-dpo-qlora", "llama-3.2-3b-grpo",
                                  "qwen3-4b-lora", "gemma-3-4b-qlora"])
def test_recipe_headers_state_what_estimate_says(hub_cache, capsys, name):
    """Each `finetune estimate ...` a header quotes prints the memory it states, and the step time where stated."""
    from finetune.resources import find_recipe

    header = " ".join(line.lstrip("# ") for line in find_recipe(name).read_text().splitlines()
                      if line.startswith("#"))
    claims = re.findall(r"`finetune estimate ([^`]+)`: ([\d.]+) GiB of ([\d.]+)([^`]*)", header)
    assert claims, f"{name}'s header gives no figure from finetune estimate"
    for command, used, capacity, rest in claims:
        printed = estimate(capsys, *command.split())
        total = re.search(r"total \(at the peak: [^)]+\)\s+([\d.]+) GiB\s+of ([\d.]+) GiB", printed)
        assert (round(float(total.group(1)), 1), round(float(total.group(2)), 1)) == (float(used), float(capacity))
        if step := re.search(r"a step ([\d.]+ m?s)", rest):
            assert re.search(rf"step +{re.escape(step.group(1))} ", printed), printed


@pytest.mark.parametrize("name", ["llama-3.2-3b-lora", "llama-3.2-3b-unsloth-qlora", "gpt-oss-20b-lora"])
def test_a_setting_left_to_its_default_is_planned_as_the_trainer_uses_it(hub_cache, capsys, name):
    """The plans read what the run will do: a recipe that sets nothing is planned exactly as one that writes out
    the trainer's defaults for every setting the plans read."""
    from finetune.resources import find_recipe

    recipe = load_recipe(find_recipe(name))
    resolved = recipe.trainer_config(use_cpu=True)  # the config the run's trainer gets, its defaults filled in
    written = []
    for key in ("gradient_checkpointing", "num_train_epochs", "max_steps", "save_steps", "eval_on_start", "loss_type"):
        value = getattr(resolved, key)
        if key not in recipe.train:
            written.append(f"train.{key}={str(value).lower() if isinstance(value, bool) else value}")
    assert written
    launch = ["--gpu", "h100", "--accelerate-config", "ddp_8xh100", "--tokens", "20000000",
              "--price-per-gpu-hour", "3"]
    assert estimate(capsys, name, *launch) == estimate(capsys, name, *written, *launch)


def test_the_loss_and_the_backwards_layers_are_planned_at_their_own_times(tmp_path):
    """The chunked loss's logits are freed before the backward recomputes its first layer: a step's peak is the
    larger of the two, not their sum. Measured on this machine's CPU (benchmarks/memory.py, an RSS timeline by
    phase): a Llama of hidden 1024 x 12 layers with the 128k vocabulary, QLoRA in fp32, gradient checkpointing,
    2 x 1024 tokens peaks at 2.11 GiB, in the loss; the backward's recomputed layers reach 1.87 GiB."""
    from transformers import LlamaConfig

    recipe = recipe_for(tmp_path, "method=qlora", "train.bf16=false", "train.gradient_checkpointing=true",
                        "train.max_length=1024", "train.per_device_train_batch_size=2", "lora.r=16",
                        "lora.dropout=0.0")
    config = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=64, vocab_size=128256, tie_word_embeddings=True)
    planned = memory_plan.plan(recipe, shapes.model_shape(config, recipe), devices.this_machine(cpu=True),
                               memory_plan.Launch(1, False, "one process"), 2)
    assert abs(planned.total() / (2.11 * devices.GIB) - 1) < 0.15
    lines = sum(line.at(2) for line in planned.lines)
    assert planned.total() < lines - 500 * devices.MIB  # the loss's 509 MiB (or the backward's) not added
    table = memory_plan.describe(planned, "medium")
    assert re.search(r"loss \(chunked\) +509 MiB  .*; only in the loss", table), table
    assert re.search(r"total \(at the peak: the (loss|backward)\) +2.1\d GiB", table), table


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_every_family_is_planned_from_its_config(hub_cache, capsys, name):
    """A Hub id whose config is in the cache: the memory plan with the family's own lines (Gemma 2's eager attention
    for its soft-capped scores, a 262k vocabulary in the chunked loss), the time plan from its FLOPs."""
    printed = estimate(capsys, "quickstart", f"model.name_or_path={name}", "method=qlora", "train.max_length=2048",
                       "train.gradient_checkpointing=true", "train.per_device_train_batch_size=2", "--gpu", "a10",
                       "--tokens", "10000000")
    total = re.search(r"total \(at the peak: the (loss|backward)\)\s+([\d.]+) GiB\s+of 22.10 GiB", printed)
    assert total and 1 < float(total.group(2)) < 22.1, printed
    assert ("eager attention" in printed) == (name == "google/gemma-2-2b-it")
    assert re.search(r"Time plan: [\d,]+ steps over 9,99\d,\d+ tokens", printed), printed


@pytest.mark.integration  # the panel plans in a child process
@pytest.mark.parametrize("name, model", [("qwen3-4b-lora", "Qwen/Qwen3-4B"),
                                         ("gemma-3-4b-qlora", "google/gemma-3-4b-it")])
def test_the_panel_lists_and_plans_the_family_recipes_and_estimate_compares_them(hub_cache, capsys, tmp_path, name,
                                                                                  model):
    """The Train tab offers each family's recipe with its model, and plans it as `finetune estimate` does; the
    launch comparison times it on A10s and H100s (both fit: the recipe's header says so)."""
    from finetune.resources import find_recipe
    from finetune.ui import train_tab
    from finetune.ui.workspace import Workspace

    workspace = Workspace(tmp_path)
    assert name in workspace.recipe_names()
    fields, message = train_tab.recipe_fields(workspace, name)
    assert message == "" and model in fields.values(), fields
    planned = workspace.estimate(name, [], "ddp_8xh100", "h100")
    assert planned == estimate(capsys, str(find_recipe(name)), "--gpu", "h100", "--accelerate-config",
                               "ddp_8xh100").strip()
    assert re.search(r"total \(at the peak: [^)]+\)\s+[\d.]+ GiB\s+of 79.10 GiB", planned), planned
    compared = estimate(capsys, name, "--compare", "a10x8,h100x8", "--tokens", "10000000")
    rows = {line.split()[0]: line.split()[1] for line in compared.splitlines() if line.startswith(("a10x8", "h100x8"))}
    assert rows == {"a10x8": "yes", "h100x8": "yes"}, compared
