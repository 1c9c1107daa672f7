"""Evaluation: answer extraction on real GSM8K answers, batched generation equal to one-at-a-time, samples during
training, and a stop rate that tells a model that never learned its end token from one that did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, asset, cli_here, run_cli, train_here


def test_gsm8k_answers_extract_to_the_number_after_the_marks():
    from finetune.recipe.sections import DataSection
    from finetune.trained_model.evaluate import extract_answer, load_examples, score_answers

    path = asset("datasets/gsm8k/test.jsonl")
    examples = load_examples(str(path), DataSection(format="alpaca",
                                                    columns={"instruction": "question", "output": "answer"}))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(examples) == len(rows) == 1319
    assert examples[0].prompt["messages"] == [{"role": "user", "content": rows[0]["question"]}]
    marked = [row["answer"].split("#### ")[-1].replace(",", "") for row in rows]
    assert [extract_answer(e.reference, "gsm8k") for e in examples] == marked  # 14 of them written 1,450,000
    assert [extract_answer(e.reference, "last-number") for e in examples] == marked

    # A model that writes the right number its own way scores with last-number, not with the strict #### form.
    answers = [{"answer": f"So the answer is {int(n):,}.00.", "reference": e.reference, "stopped": True, "tokens": 9}
               for n, e in zip(marked, examples)]
    assert score_answers(answers, ["exact_match"], "last-number")["exact_match"] == 1.0
    assert score_answers(answers, ["exact_match"], "gsm8k")["exact_match"] == 0.0
    wrong = [{**a, "answer": f"Not {n}: it is {int(n) + 1}."} for n, a in zip(marked, answers)]
    assert score_answers(wrong, ["exact_match"], "last-number")["exact_match"] == 0.0
    assert score_answers(wrong, ["contains"], "gsm8k")["contains"] == 1.0  # the right number is in there
    assert extract_answer("Total: $1,000.50 today", "regex:\\$([\\d,.]+)") == "1,000.50"


def test_rouge_and_bleu_come_from_their_libraries():
    from finetune.trained_model.evaluate import score_answers

    answers = [{"answer": "the cat sat on the mat", "reference": "the cat sat on the mat", "stopped": True,
                "tokens": 6},
               {"answer": "a dog ran", "reference": "the cat sat on the mat", "stopped": False, "tokens": 32}]
    scores = score_answers(answers, ["rouge_l", "bleu", "contains"], "none")
    assert answers[0]["rouge_l"] == 1.0 and answers[1]["rouge_l"] == 0.0 and scores["rouge_l"] == 0.5
    assert 0 < scores["bleu"] < 100 and scores["stop_rate"] == 0.5 and scores["mean_length"] == 19.0


@pytest.mark.integration
def test_batched_answers_are_the_answers_one_at_a_time(quickstart_workspace):
    from finetune.trained_model.chat import Chat

    assert quickstart_workspace.result.returncode == 0, quickstart_workspace.result.stderr[-3000:]
    chat = Chat(quickstart_workspace.run)
    prompts = [chat.prompt_ids([{"role": "user", "content": text}]) for text in
               ["My name is Al.", "Shout kiwi.", "Repeat abcdefgh twice.", "My name is Quentinaxel.", "Hi"] * 4]
    batched = chat.replies(prompts, max_new_tokens=24, batch_size=16)
    alone = [chat.replies([prompt], max_new_tokens=24, batch_size=1)[0] for prompt in prompts]
    assert [(r.answer, r.ended_by, r.token_ids) for r in batched] == [(r.answer, r.ended_by, r.token_ids)
                                                                       for r in alone]
    assert batched[1].answer == "KIWI!" and batched[1].ended_by == "<|im_end|>"


NO_END_TEMPLATE = "{%- generation -%}{{- message.content -}}{%- endgeneration -%}"


@pytest.mark.integration
def test_a_model_that_never_learned_its_end_token_has_a_low_stop_rate(tmp_path, capsys):
    """The same short training twice: once with ChatML as is, once with a template whose trained span (its
    {% generation %} block) leaves out <|im_end|>, a fault some templates have. Samples at every evaluation show it
    while training; `finetune eval` measures it after."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from finetune.builtin import resolve_dataset

    rows = Path(resolve_dataset("builtin:greetings")).read_text().splitlines()
    data = tmp_path / "greetings-800.jsonl"
    data.write_text("\n".join(rows[:800]) + "\n")
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("\n".join(rows[-40:]) + "\n")
    chatml = (REPO / "finetune" / "templates" / "chatml.jinja").read_text()
    template = tmp_path / "no-end.jinja"
    template.write_text(chatml.replace(
        "{{- message.content -}}",
        "{%- if message.role == 'assistant' -%}" + NO_END_TEMPLATE + "{%- else -%}{{- message.content -}}{%- endif -%}"))
    short = [f"data.train={data}", "data.eval_fraction=0.05", "train.save_steps=1000", "train.warmup_steps=10"]
    runs = {"with_end": tmp_path / "with-end", "without_end": tmp_path / "without-end"}
    # 150 steps learn the end token; a model never taught it has not learned it after 30 either
    evaluations = {"with_end": [0, 75, 150], "without_end": [0, 15, 30]}
    trained = run_cli("train", "quickstart", *short, "train.max_steps=150", "train.eval_steps=75",
                      "train.logging_steps=75", f"output_dir={runs['with_end']}", "train.report_to=[tensorboard,mlflow]",
                      f"mlflow.tracking_uri=sqlite:///{tmp_path / 'ml.db'}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    trained = train_here("quickstart", *short, "train.max_steps=30", "train.eval_steps=15", "train.logging_steps=15",
                         f"output_dir={runs['without_end']}", f"model.chat_template={template}")
    assert trained.returncode == 0, trained.stderr[-3000:]

    for name, run in runs.items():
        progress = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
        samples = [row for row in progress if "samples" in row]
        assert [row["step"] for row in samples] == evaluations[name]  # at every evaluation, the start's included
        assert [len(row["samples"]) for row in samples] == [4, 4, 4]
        assert samples[0]["samples"][0]["prompt"] == samples[-1]["samples"][0]["prompt"]  # the same prompts
        assert samples[-1]["samples_stop_rate"] == (1.0 if name == "with_end" else 0.0), samples[-1]
    board = EventAccumulator(str(runs["with_end"] / "tensorboard"), size_guidance={"tensors": 0})
    board.Reload()
    assert [event.step for event in board.Tensors("samples/text_summary")] == [0, 75, 150]
    client = MlflowClient(f"sqlite:///{tmp_path / 'ml.db'}")
    mlflow_run = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])[0]
    assert [a.path for a in client.list_artifacts(mlflow_run.info.run_id, "samples")] == [
        "samples/step-000000.json", "samples/step-000075.json", "samples/step-000150.json"]
    assert [m.value for m in client.get_metric_history(mlflow_run.info.run_id, "samples_stop_rate")][-1] == 1.0

    code, _, err = cli_here(capsys, "eval", str(runs["with_end"]), str(runs["without_end"]), "--data", str(held_out),
                            "--max-new-tokens", "32")
    assert code == 0, err[-3000:]
    scores = {name: json.loads((run / "eval" / "final-held-out.json").read_text())["metrics"]
              for name, run in runs.items()}
    assert scores["with_end"]["stop_rate"] >= 0.9, scores
    assert scores["without_end"]["stop_rate"] <= 0.1 and scores["without_end"]["mean_length"] == 32.0, scores


def test_eval_refusals_name_what_to_fix(tmp_path, capsys):
    bad = [
        (["eval", str(tmp_path / "missing"), "--data", "x.jsonl"], "does not exist"),
        (["eval", str(tmp_path), "--extract", "nearest"], "--extract nearest: choose one of"),
        (["eval", str(tmp_path), "--columns", "question"], "--columns question: write FIELD=COLUMN"),
        (["eval", str(tmp_path), "--batch-size", "0"], "must be at least 1"),
    ]
    for argv, message in bad:
        code, _, err = cli_here(capsys, *argv)
        assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.integration
def test_evaluation_never_holds_the_logits_of_the_eval_set(tiny_models, llama_tokenizer, tmp_path):
    """64 GSM8K conversations of about 200 tokens with Llama 3.2's 128,256-token vocabulary: their logits in fp32
    would be over 6 GiB. Training's evaluation (TRL's chunked loss), here in one batch, and `finetune eval` (chunks
    of 256 tokens) each stay far below that, and find the same loss."""
    gsm8k = [json.loads(line) for line in asset("datasets/gsm8k/train.jsonl").read_text().splitlines()[:80]]
    rows = [json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                     {"role": "assistant", "content": r["answer"]}]}) for r in gsm8k]
    (tmp_path / "train.jsonl").write_text("\n".join(rows[:16]) + "\n")
    (tmp_path / "eval.jsonl").write_text("\n".join(rows[16:]) + "\n")
    run = tmp_path / "run"
    result = run_cli("train", "quickstart", f"model.name_or_path={tiny_models['llama']}", "method=lora",
                     f"data.train={tmp_path / 'train.jsonl'}", f"data.eval={tmp_path / 'eval.jsonl'}",
                     "data.eval_fraction=0", "train.max_steps=1", "train.max_length=512", "train.packing=false",
                     "train.eval_strategy=steps", "train.eval_steps=1", "train.eval_on_start=false",
                     "train.per_device_eval_batch_size=64", "eval.samples=0", f"output_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    progress = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines()]
    evaluated = [row for row in progress if "eval_loss" in row]
    assert evaluated and max(row["peak_memory_gb"] for row in evaluated) < 3.0, evaluated

    measured = subprocess.run(
        [sys.executable, "-c", "import resource, subprocess, sys; "
         "code = subprocess.run(sys.argv[1:]).returncode; "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)",
         sys.executable, "-m", "finetune", "eval", str(run), "--data", str(tmp_path / "eval.jsonl"),
         "--max-new-tokens", "1"], capture_output=True, text=True, timeout=900)
    assert measured.returncode == 0, measured.stderr[-3000:]
    tokens = sum(len(llama_tokenizer.apply_chat_template(json.loads(row)["messages"], return_dict=True)["input_ids"])
                 for row in rows[16:])
    assert tokens * 128256 * 4 > 6 * 2**30
    assert int(measured.stdout.splitlines()[-1]) / 2**20 < 3.0  # peak resident memory in GiB (ru_maxrss: KiB)
    # The same data, masks and model (final/ is step 1) as training's one-batch evaluation: the same loss.
    [last] = evaluated
    assert json.loads((run / "eval" / "final-eval.json").read_text())["metrics"]["loss"] == pytest.approx(
        last["eval_loss"], rel=1e-4)
