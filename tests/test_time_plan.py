"""The time plan: FLOPs counted from the shape against torch's own counter, the steps a run takes, the all-reduce of
several GPUs, and `finetune estimate`'s time and cost lines."""

from __future__ import annotations

import json

import pytest

from finetune.models.architectures import tiny_gpt_oss, tiny_llama_3_2
from finetune.plan import devices, flops, memory_plan, shapes, time_plan
from finetune.recipe.schema import load_recipe, recipe_from_dict
from tests.conftest import cli_here, train_here, write_recipe


def recipe(method: str, **train):
    return recipe_from_dict({"model": {"name_or_path": "some/model"}, "data": {"train": "data.jsonl"},
                             "method": method, "train": train, "output_dir": "run"})


def counted_step(config, method: str, checkpointing: bool, length: int, trained_from: int) -> tuple[float, float]:
    """(torch.utils.flop_counter's count of one training step, the plan's) on one example: the decoder, the head on
    the tokens that carry loss only (as TRL's chunked loss), backward. Eager attention, which the counter sees."""
    import torch
    from peft import get_peft_model
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from finetune.models.loading import lora_config

    torch.manual_seed(0)
    planned_recipe = recipe(method)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if method != "full":
        model = get_peft_model(model, lora_config(planned_recipe, model))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if method != "full":
            model.enable_input_require_grads()  # as TRL does for PEFT with gradient checkpointing
    model.train()
    base = model.get_base_model() if method != "full" else model
    ids = torch.randint(0, 1000, (1, length))
    with FlopCounterMode(display=False) as counter:
        hidden = base.model(input_ids=ids).last_hidden_state[0, trained_from:]
        loss = torch.nn.functional.cross_entropy(base.lm_head(hidden), torch.randint(0, 1000, (len(hidden),)))
        loss.backward()
    shape = shapes.model_shape(config, planned_recipe)
    work = flops.Work(length, length - trained_from, (length,))
    return counter.get_total_flops(), flops.count(shape, flops.layout_of(config), method, checkpointing, work).total


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_flops_of_a_dense_model_are_the_counters(method, checkpointing):
    from transformers import LlamaConfig

    # layers, not the head, dominate: the count of the decoder is what this checks
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    measured, planned = counted_step(config, method, checkpointing, length=256, trained_from=100)
    assert planned == pytest.approx(measured, rel=0.005)
    measured, planned = counted_step(tiny_llama_3_2(), method, checkpointing, length=48, trained_from=16)
    assert planned == pytest.approx(measured, rel=0.005)  # the real vocabulary: the head on trained tokens only


@pytest.mark.parametrize("method", ["full", "lora"])
def test_flops_of_a_mixture_of_experts_count_the_experts_a_token_reaches(method):
    measured, planned = counted_step(tiny_gpt_oss(), method, checkpointing=False, length=16, trained_from=6)
    assert planned == pytest.approx(measured, rel=0.02)


def test_the_rules_of_thumb_are_shown_beside_the_count():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    shape = shapes.model_shape(config, recipe("full"))
    counted = flops.count(shape, flops.layout_of(config), "full", False, flops.Work(512, 512, (512,)))
    assert counted.rule_of_thumb == 6 * shape.parameters * 512
    windowed = flops.Layout(window=128, windowed_layers=4, experts=0)
    assert flops.count(shape, windowed, "full", False, flops.Work(512, 512, (512,))).total < counted.total


def test_steps_are_the_trainers():
    assert time_plan.steps_of(recipe("lora"), 1000, 4, 1, 1) == 750  # TRL's default: 3 epochs
    # 1,783 packed rows of 8 per step for 10 epochs: the quickstart's 2,230 steps
    assert time_plan.steps_of(recipe("full", num_train_epochs=10), 1783, 8, 1, 1) == 2230
    assert time_plan.steps_of(recipe("lora", num_train_epochs=1), 1000, 4, 4, 2) == 32  # 125 batches per process, 4 per step
    assert time_plan.steps_of(recipe("lora", num_train_epochs=3, max_steps=7), 1000, 4, 1, 1) == 7


def test_ddp_moves_the_gradients_of_what_trains_over_the_link():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    a10 = devices.device_named("a10")
    lora, full = (shapes.model_shape(config, recipe(method)) for method in ("lora", "full"))
    ddp8 = memory_plan.launch_of(None, 8)
    exposed, note = time_plan._communication(lora, "lora", ddp8, a10, compute_s=1.0, backward_s=0.0)
    assert exposed == pytest.approx(2 * 7 / 8 * lora.adapter * 4 / (32e9 * time_plan.LINK_ACHIEVED))
    assert f"{lora.adapter * 4 / 1e6:,.1f} MB of gradients" in note and "PCIe Gen4 x16" in note
    hidden, _ = time_plan._communication(full, "full", ddp8, a10, compute_s=1.0, backward_s=10.0)
    assert hidden == pytest.approx(2 * 7 / 8 * min(full.parameters * 2, time_plan.DDP_BUCKET) / (32e9 * 0.75))


def test_a_measured_bus_bandwidth_replaces_the_link_figure(capsys):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    lora = shapes.model_shape(config, recipe("lora"))
    ddp4 = memory_plan.launch_of(None, 4)
    exposed, note = time_plan._communication(lora, "lora", ddp4, devices.device_named("cpu"), compute_s=1.0,
                                             backward_s=0.0, bus_bytes=2e9)
    assert exposed == pytest.approx(2 * 3 / 4 * lora.adapter * 4 / 2e9)
    assert "over the measured bus bandwidth (2.0 GB/s, --bus-gb-s)" in note
    code, _, err = cli_here(capsys, "estimate", "quickstart", "--gpu", "a10", "--num-gpus", "2", "--bus-gb-s", "0")
    assert code == 2 and err == "error: --bus-gb-s must be above 0 (GB/s, as `finetune doctor --ddp` prints it)\n"


def test_qlora_dequantizes_every_4_bit_weight_at_the_cards_memory_bandwidth(capsys):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    a10, alone = devices.device_named("a10"), memory_plan.launch_of(None, 1)
    work = flops.Work(4096, 4096, (512,) * 8)
    plans = {}
    for method in ("lora", "qlora"):
        planned = recipe(method, gradient_checkpointing=True, per_device_train_batch_size=2,
                         gradient_accumulation_steps=4, max_steps=10, max_length=512)
        shape = shapes.model_shape(config, planned)
        plans[method] = time_plan.plan_time(planned, shape, flops.layout_of(config), work, 8, None, a10, alone, 2,
                                            time_plan.assumed_speed(a10, "hf"))
    # forward, backward and the recomputed forward, each micro-step: 4.5 bytes of memory traffic per weight
    expected = 3 * shape.linear * time_plan.DEQUANTIZE_BYTES * 4 / 600e9
    assert plans["qlora"].dequantize_s == pytest.approx(expected) and plans["lora"].dequantize_s == 0
    assert plans["qlora"].compute_s - plans["lora"].compute_s == pytest.approx(expected)
    assert any(note.startswith("4-bit dequantization: ") for note in plans["qlora"].notes)
    code, out, err = cli_here(capsys, "estimate", "quickstart", "method=qlora", "--gpu", "a10")
    assert code == 0, err
    step = next(line for line in out.splitlines() if line.lstrip().startswith("step "))
    assert " with 4-bit dequantization " in step


def test_compare_refuses_an_unknown_card_with_the_known_ones(capsys):
    code, _, err = cli_here(capsys, "estimate", "quickstart", "--compare", "a10x8,b200x8")
    assert code == 2 and err == ("error: --compare 'b200x8': write CARDxCOUNT with a card of a10, l4, a100-40, "
                                 "a100-80, h100, h200, e.g. --compare a10x8,h100x8,h200x1\n")


def test_estimate_plans_time_and_cost(capsys, tmp_path):
    prices = write_recipe(tmp_path, "a10: 1.10\nh100: 3.50\n", "prices.yaml")
    code, out, err = cli_here(capsys, "estimate", "quickstart", "--gpu", "a10", "--price-per-gpu-hour", "2")
    assert code == 0, err
    plan = out.split("Time plan: ")[1]
    assert plan.startswith("2,230 steps over ") and "counted from the prepared data" in plan
    assert "assumed: 35% of the card's 125 TFLOPS dense bf16 peak (hf backend" in plan
    cost = next(line for line in plan.splitlines() if line.lstrip().startswith("cost"))
    assert "(1 GPU x " in cost and "at $2.00 per GPU-hour)" in cost and float(cost.split("$")[1].split()[0]) > 0
    code, out, err = cli_here(capsys, "estimate", "quickstart", "--compare", "a10x1,h100x8", "--prices", str(prices))
    assert code == 0, err
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:3]}
    assert set(rows) == {"a10x1", "h100x8"} and rows["a10x1"][1] == rows["h100x8"][1] == "yes"
    assert rows["a10x1"][-1].startswith("$") and rows["h100x8"][-1].startswith("$")
    code, out, _ = cli_here(capsys, "estimate", "quickstart", "--compare", "a10x1")
    assert code == 0 and "--prices FILE (card: price per GPU-hour) adds the cost" in out


def test_estimate_without_data_says_why_and_plans_from_a_token_count(capsys, tmp_path):
    path = write_recipe(tmp_path, "model: {name_or_path: builtin:tiny-llama}\ndata: {train: missing.jsonl}\n")
    code, out, _ = cli_here(capsys, "estimate", str(path), "--gpu", "h100")
    assert code == 0 and "Time and cost: not planned: " in out and "--tokens N plans from a token count" in out
    code, out, _ = cli_here(capsys, "estimate", str(path), "--gpu", "h100", "--tokens", "1000000")
    rows = 1_000_000 // load_recipe(path).train["max_length"]
    assert code == 0 and f"in {rows:,} rows (from --tokens: rows of max_length, every token carrying loss; " in out


def test_a_stage_the_plan_does_not_count_is_said_not_planned(capsys, tmp_path):
    prefs = write_recipe(tmp_path, json.dumps({"prompt": "Pick a color.", "chosen": "blue", "rejected": "red"}) + "\n",
                         "prefs.jsonl")
    code, out, err = cli_here(capsys, "estimate", "quickstart", "stage=dpo", f"data.train={prefs}", "--gpu", "a10")
    assert code == 0 and "Traceback" not in err, err
    assert ("Time and cost: not planned: the time plan counts supervised fine-tuning's work; stage dpo's (two answers "
            "per pair and a reference model's forward passes, or GRPO's generation) is not counted yet") in out


def test_a_finished_run_of_the_recipe_gives_this_machines_speed(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": step, "loss": 1.0, "tokens_per_second": rate} for step, rate in ((20, 50.0), (40, 1000.0),
                                                                                         (60, 1200.0), (80, 1100.0))]
    (run / "progress.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, out, err = cli_here(capsys, "estimate", "quickstart", f"output_dir={run}", "--device", "cpu")
    assert code == 0, err
    assert "speed             measured: " in out and f"({run}: 1,100 tokens/s in its progress.jsonl)" in out
    tokens_per_s = next(line for line in out.splitlines() if line.lstrip().startswith("tokens/s"))
    assert tokens_per_s.split()[1] == "1,100"  # the plan runs at the speed the run measured
    # the panel's Runs table: the step the run ended at (past its last logged loss) and the same speed
    pytest.importorskip("gradio", reason="the panel's extra is not installed: pip install -e '.[ui]'")
    from finetune.ui.runs_tab import overview
    from finetune.ui.workspace import Workspace

    with (run / "progress.jsonl").open("a") as progress:
        progress.write(json.dumps({"status": "completed", "step": 85, "elapsed_s": 12.0}) + "\n")
    (tmp_path / "runs").mkdir()
    run.rename(tmp_path / "runs" / "run")
    table, _, _ = overview(Workspace(tmp_path), None)
    assert (table.loc[0, "steps"], table.loc[0, "tokens/s"]) == (85, 1100)


def test_processes_on_one_cpu_share_the_speed_a_run_measured_there(capsys, tmp_path):
    """A DDP run on this CPU logged the machine's tokens/s, its two processes sharing the cores: a plan here on one
    process or on two runs at that speed (two, less their all-reduce), never at twice it."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 20, "loss": 1.0, "tokens_per_second": 50.0},
            {"step": 20, "resumed": {"from": "checkpoint-20", "processes": 2, "at": 0}},
            *({"step": step, "loss": 1.0, "tokens_per_second": 1000.0} for step in (40, 60))]
    (run / "progress.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    in_all = {}
    for processes, launch in ((1, []), (2, ["--accelerate-config", "cpu_ddp_2proc"])):
        code, out, err = cli_here(capsys, "estimate", "quickstart", f"output_dir={run}", "--device", "cpu", *launch)
        assert code == 0, err
        assert f"({run}: 1,000 tokens/s (2 processes sharing the CPU) in its progress.jsonl)" in out
        line = next(line for line in out.splitlines() if line.lstrip().startswith("tokens/s")).split()
        in_all[processes] = float(line[4].replace(",", ""))
    assert in_all[1] == 1000 and 900 < in_all[2] <= 1000


def test_a_run_plans_its_time_from_the_run_before_it_and_the_live_tab_sets_the_plan_beside_the_eta(tmp_path, capsys):
    from finetune.run_folder import read_rows
    from finetune.ui.live_tab import status_card
    from finetune.ui.run_info import RunInfo

    short = ["train.max_steps=3", "train.logging_steps=1", "train.save_strategy=no", "train.eval_strategy=no",
             "train.eval_on_start=false", "data.eval_fraction=0", "eval.samples=0"]
    first = train_here("quickstart", *short, f"output_dir={tmp_path / 'runs' / 'first'}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "time plan:" not in first.stdout  # on a CPU, with no run here before it, no speed is known
    assert not any("plan" in row for row in read_rows(tmp_path / "runs" / "first"))
    second = train_here("quickstart", *short, "train.max_steps=4", f"output_dir={tmp_path / 'runs' / 'second'}")
    assert second.returncode == 0, second.stderr[-3000:]
    [plan] = [row["plan"] for row in read_rows(tmp_path / "runs" / "second") if "plan" in row]
    assert plan["steps"] == 4 and plan["total_s"] > 0 and plan["device"] == "this machine's CPU"
    assert plan["speed"].startswith("measured: ") and f"({tmp_path / 'runs' / 'first'}: " in plan["speed"]
    assert f"time plan: 4 steps in {time_plan.format_duration(plan['total_s'])} on this machine's CPU (" \
        in second.stdout
    # `finetune estimate` for a third run beside them plans from the newest
    code, out, err = cli_here(capsys, "estimate", "quickstart", f"output_dir={tmp_path / 'runs' / 'third'}",
                              "--device", "cpu")
    assert code == 0 and f"({tmp_path / 'runs' / 'second'}: " in out, err

    rows = [{"step": 0, "plan": {**plan, "total_s": 120.0, "steps": 10}},
            {"step": 5, "loss": 1.0, "tokens_per_second": 100.0, "total_steps": 10, "elapsed_s": 50.0}]
    card = status_card(RunInfo("second", "running", rows, started=None))
    assert "ETA **0m50s** (planned 1m00s)" in card
    assert f"Time plan at the start: **2m00s** for 10 steps on this machine's CPU · {plan['speed']}" in card


def test_estimate_says_figures_as_people_read_them(capsys):
    code, out, err = cli_here(capsys, "estimate", "quickstart", "--compare", "a10x1,h100x8", "--price-per-gpu-hour",
                              "2.5", "--tokens", "5e5")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.startswith(("a10x1", "h100x8"))]
    assert len(rows) == 2 and all(row[-1].startswith("$") for row in rows)  # one price for every card compared
    code, out, _ = cli_here(capsys, "estimate", "quickstart", "--gpu", "24GB", "--tokens", "256")
    assert code == 0 and "Time and cost: not planned: a 24GB GPU's speed is not known; name the card instead " \
                         "(--gpu a10, " in out and "or run --probe on that card to measure it" in out
    code, out, _ = cli_here(capsys, "estimate", "quickstart", "--gpu", "a10", "--tokens", "256",
                            "train.max_steps=1")
    assert "Time plan: 1 step over 256 tokens" in out
    from finetune.commands.plan_commands import _seconds

    assert [_seconds(s) for s in (0.729, 4.51, 75)] == ["729 ms", "4.51 s", "1m15s"]
