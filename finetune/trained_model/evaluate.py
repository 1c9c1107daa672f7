"""Evaluation: what a model says, and how well, on held-out data. The library behind `finetune eval`, the samples
written during training and the panel's Evaluate tab.

A target is a trained model (a run's final/, a checkpoint-N/, an export) or `base:PATH`, the model PATH's run
started from, through the same template. For each target:

    loss         mean cross-entropy over the tokens that carry loss, rendered and masked exactly as in training
                 (the target's template, masks and max_length), computed in chunks: the logits of more than
                 LOSS_CHUNK tokens are never held at once; perplexity is exp(loss)
    answers      greedy, batched generation (Chat.replies) to each example's prompt: the conversation before its
                 last assistant turn, or a prompt-completion row's prompt
    metrics      exact_match and contains after answer extraction (GSM8K's `#### N`, the last number, or a regex),
                 rouge_l (Google's rouge-score) and bleu (sacrebleu), stop_rate (answers that ended with an end
                 token before max_new_tokens) and mean_length (generated tokens)
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.answers import check_extraction, extract_answer
from finetune.errors import UserError
from finetune.trained_model import harness

METRICS = ("exact_match", "contains", "rouge_l", "bleu")
DEFAULT_METRICS = ("exact_match", "contains")
ALWAYS = ("loss", "perplexity", "stop_rate", "mean_length")
LOSS_CHUNK = 256  # tokens whose full-vocabulary logits are held at once
EVAL_FOLDER = "eval"  # in a run folder: one results file and one answers file per (model, data)


@dataclass
class Example:
    where: str  # file and row
    encoded: dict  # the normalized example, for the loss
    prompt: dict | None  # {"messages", "tools"} or {"text"}; None when nothing in it is a prompt (plain text)
    reference: str | None


@dataclass
class Target:
    spec: str
    label: str  # final | checkpoint-N | base | the export's folder name
    saved: Any  # saved_model.SavedModel
    base: bool = False

    @property
    def run(self) -> Path | None:
        return self.saved.run


@dataclass
class Result:
    target: str
    label: str
    metrics: dict[str, float]
    answers: list[dict] = field(default_factory=list)
    tasks: dict[str, float] = field(default_factory=dict)
    kept: list[Path] = field(default_factory=list)  # its answers files


# Targets and data.
def resolve_target(spec: str) -> Target:
    from finetune.run_folder import FINAL_NAME, checkpoint_step
    from finetune.trained_model import saved_model

    base = spec.startswith(saved_model.BASE_PREFIX)
    saved = saved_model.locate(spec.removeprefix(saved_model.BASE_PREFIX))
    if base:
        return Target(spec, "base", saved, base=True)
    if checkpoint_step(saved.path) is not None:
        label = saved.path.name
    else:
        label = FINAL_NAME if saved.run is not None else saved.path.name
    return Target(spec, label, saved)


def load_examples(spec: str, data_section, limit: int | None = None) -> list[Example]:
    """Rows of a data file (any format training reads, with the recipe's columns), normalized; a bad row stops
    it with the file and row named. Of preference data, the chosen answer is the reference."""
    from finetune.data import sources
    from finetune.data.pipeline import bad_rows_error, read_examples
    from finetune.data.spool import Spool
    from finetune.data.stage_rows import answer_example

    bad = []
    with Spool() as spool:
        found = read_examples([sources.resolve(spec, "--data")], data_section, bad, spool, stage="any")
        if bad:
            raise bad_rows_error(bad)
        if not found:
            raise UserError(f"--data {spec}: no rows")
        examples = [split_example(spool.where(example), answer_example(spool.get(example))) for example in found]
    return examples[:limit] if limit else examples


def held_out(pool: list[dict], count: int, renderer) -> list[Example]:
    """The first `count` examples of the eval split's first ones (PreparedData.eval_examples) that have a prompt
    the template renders (a bad row that was dropped has none)."""
    from finetune.data.formats import BadRow

    chosen = []
    for entry in pool:
        example = split_example(entry["where"], {k: v for k, v in entry.items() if k != "where"})
        if example.prompt is None:
            continue
        try:
            prompt_ids(example, renderer)
        except BadRow:
            continue
        chosen.append(example)
        if len(chosen) == count:
            break
    return chosen


def split_example(where: str, example: dict) -> Example:
    """The prompt (what comes before the answer) and the reference answer of an example."""
    if "segments" in example:
        segments = example["segments"]
        prompt = "".join(s["text"] for s in segments if not s["train"])
        reference = "".join(s["text"] for s in segments if s["train"])
        return Example(where, example, {"text": prompt} if prompt else None, reference if prompt else None)
    messages = example["messages"]
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:  # a conversation to answer, with no reference
        return Example(where, example, {"messages": messages, "tools": example.get("tools")}, None)
    return Example(where, example, {"messages": messages[:last], "tools": example.get("tools")},
                   messages[last].get("content") or "")


def prompt_ids(example: Example, renderer) -> list[int]:
    if "text" in example.prompt:
        return renderer.tokenizer(example.prompt["text"], add_special_tokens=True)["input_ids"]
    return renderer.prompt_ids(example.prompt["messages"], example.prompt["tools"])


# Metrics.
def check_metrics(names: list[str]) -> None:
    unknown = [name for name in names if name not in METRICS]
    if unknown:
        raise UserError(f"--metric {unknown[0]}: choose from {', '.join(METRICS)} ({', '.join(ALWAYS)} are always "
                        "reported)")
    for name, module in (("rouge_l", "rouge_score"), ("bleu", "sacrebleu")):
        if name in names:
            import importlib.util

            if importlib.util.find_spec(module) is None:
                raise UserError(f"--metric {name} needs the eval extra: pip install -e \".[eval]\"")


def score_answers(answers: list[dict], metrics: list[str], extract: str) -> dict[str, float]:
    """Per-answer scores are added to each answer (a dict with answer, reference, stopped, tokens); the means are
    returned, with stop_rate and mean_length."""
    summary: dict[str, float] = {}
    if not answers:
        return summary
    scored = [a for a in answers if a["reference"] is not None]
    if "rouge_l" in metrics:
        from rouge_score import rouge_scorer

        scorer = rouge_scorer.RougeScorer(["rougeL"])
    for answer in scored:
        mine, theirs = extract_answer(answer["answer"], extract), extract_answer(answer["reference"], extract)
        answer["extracted"] = mine
        if "exact_match" in metrics:
            answer["exact_match"] = float(mine is not None and mine == theirs)
        if "contains" in metrics:
            answer["contains"] = float(bool(theirs) and theirs in answer["answer"])
        if "rouge_l" in metrics:
            answer["rouge_l"] = scorer.score(answer["reference"], answer["answer"])["rougeL"].fmeasure
    for name in ("exact_match", "contains", "rouge_l"):
        if name in metrics and scored:
            summary[name] = sum(a[name] for a in scored) / len(scored)
    if "bleu" in metrics and scored:
        import sacrebleu

        summary["bleu"] = sacrebleu.corpus_bleu([a["answer"] for a in scored], [[a["reference"] for a in scored]]).score
    summary["stop_rate"] = sum(a["stopped"] for a in answers) / len(answers)
    summary["mean_length"] = sum(a["tokens"] for a in answers) / len(answers)
    return summary


def answer_rows(chat, examples: list[Example], max_new_tokens: int, batch_size: int,
                synced: bool = False) -> list[dict]:
    """Each example with a prompt, answered: prompt (as text), answer, reference, stopped, tokens. `synced`: as
    Chat.replies."""
    from finetune.data.formats import BadRow

    asked = [e for e in examples if e.prompt is not None]
    ids = []
    for example in asked:
        try:
            ids.append(prompt_ids(example, chat.renderer))
        except BadRow as error:
            raise UserError(f"{example.where}: {error}") from None
    replies = chat.replies(ids, max_new_tokens, batch_size, synced)
    rows = []
    for example, prompt, reply in zip(asked, ids, replies):
        generated = len(reply.token_ids) - (reply.ended_by is not None)
        rows.append({"where": example.where, "prompt": _last_user_text(example, chat.tokenizer, prompt),
                     "answer": reply.answer, "reference": example.reference, "stopped": reply.ended_by is not None,
                     "tokens": generated, **({"thinking": reply.thinking} if reply.thinking else {})})
    return rows


def samples_markdown(samples: list[dict]) -> str:
    """Samples as a Markdown table (TensorBoard's text panel renders it)."""
    def cell(text) -> str:
        return str(text if text is not None else "").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| prompt | answer | reference | stopped |", "|---|---|---|---|"]
    lines += [f"| {cell(s['prompt'])} | {cell(s['answer'])} | {cell(s['reference'])} | {'yes' if s['stopped'] else 'no'} |"
              for s in samples]
    return "\n".join(lines)


def _last_user_text(example: Example, tokenizer, ids: list[int]) -> str:
    if "text" in example.prompt:
        return example.prompt["text"]
    users = [m for m in example.prompt["messages"] if m["role"] == "user"]
    content = users[-1].get("content") if users else None
    return content if isinstance(content, str) else tokenizer.decode(ids)


# Loss.
def mean_loss(model, renderer, examples: list[Example], max_length: int, batch_size: int) -> dict[str, float]:
    """Token-weighted mean cross-entropy over the tokens that carry loss, as training masks them, and its exp."""
    import torch

    from finetune.data.formats import BadRow
    from finetune.data.render import IGNORE

    encoded = []
    for example in examples:
        try:
            ids, labels = renderer.encode(example.encoded)
        except BadRow as error:
            raise UserError(f"{example.where}: {error}") from None
        if any(label != IGNORE for label in labels[1:max_length]):
            encoded.append((ids[:max_length], labels[:max_length]))
    if not encoded:
        return {}
    pad = renderer.tokenizer.pad_token_id or 0
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone, head = causal.base_model, causal.get_output_embeddings()
    total, count = 0.0, 0
    encoded.sort(key=lambda pair: len(pair[0]))  # similar lengths together: less padding
    with torch.inference_mode():
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start:start + batch_size]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch], device=model.device)
            labels = torch.tensor([l + [IGNORE] * (width - len(l)) for _, l in batch], device=model.device)
            mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch], device=model.device)
            hidden = backbone(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            hidden, targets = hidden[:, :-1][labels[:, 1:] != IGNORE], labels[:, 1:][labels[:, 1:] != IGNORE]
            for chunk in range(0, len(targets), LOSS_CHUNK):
                logits = head(hidden[chunk:chunk + LOSS_CHUNK]).float()
                total += torch.nn.functional.cross_entropy(logits, targets[chunk:chunk + LOSS_CHUNK],
                                                           reduction="sum").item()
            count += len(targets)
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}


# The command.
@dataclass
class Settings:
    data: str | None
    metrics: list[str]
    extract: str = "none"
    max_new_tokens: int = 256
    batch_size: int = 16
    limit: int | None = None
    tasks: list[str] = field(default_factory=list)
    include_tasks: list[str] = field(default_factory=list)
    format: str | None = None
    columns: dict[str, str] = field(default_factory=dict)


def evaluate(specs: list[str], settings: Settings, out: Path | None = None, say=print) -> list[Result]:
    """Evaluate each target on the data; keep the results beside each run, and in `out` if given."""
    import dataclasses
    import gc

    check_metrics(settings.metrics)
    check_extraction(settings.extract)
    if settings.data is None and not settings.tasks:
        raise UserError("nothing to evaluate on: give --data FILE, --tasks NAME, or both")
    targets = [resolve_target(spec) for spec in specs]  # every path checked before any model loads
    data_section = dataclasses.replace(
        targets[0].saved.recipe.data, **({"format": settings.format} if settings.format else {}),
        **({"columns": settings.columns} if settings.columns else {}))
    examples = load_examples(settings.data, data_section, settings.limit) if settings.data else []
    results = []
    for target in targets:
        started = time.monotonic()
        say(f"evaluating {target.spec} ...")
        result = evaluate_one(target, examples, settings)
        say(f"  done in {time.monotonic() - started:.1f}s")
        results.append(result)
        result.kept = keep(result, target, settings, out)
        gc.collect()
    return results


def evaluate_one(target: Target, examples: list[Example], settings: Settings) -> Result:
    from finetune.trained_model.chat import Chat

    chat = Chat(target.saved.path, base=target.base)
    recipe = target.saved.recipe
    metrics: dict[str, float] = {}
    answers: list[dict] = []
    if examples:
        chat.renderer.loss_on, chat.renderer.train_thinking = recipe.data.loss_on, recipe.data.train_thinking
        metrics.update(mean_loss(chat.model, chat.renderer, examples, recipe.train_setting("max_length"),
                                 settings.batch_size))
        answers = answer_rows(chat, examples, settings.max_new_tokens, settings.batch_size)
        metrics.update(score_answers(answers, settings.metrics, settings.extract))
    tasks = harness.run_tasks(chat, settings.tasks, settings.include_tasks, settings.batch_size, settings.limit) \
        if settings.tasks else {}
    return Result(target.spec, target.label, metrics, answers, tasks)


def keep(result: Result, target: Target, settings: Settings, out: Path | None) -> list[Path]:
    """RUN/eval/<label>-<data>.json and .answers.jsonl for targets of a run, and <out>/<target>.json and
    .answers.jsonl; the answers files."""
    data_name = safe_name(Path(settings.data).stem) if settings.data else "tasks"
    places = []
    if target.run is not None:
        places.append(target.run / EVAL_FOLDER / f"{result.label}-{data_name}")
    if out is not None:
        places.append(out / safe_name(f"{result.target}"))
    return [write_result(stem, result, settings) for stem in places]


def write_result(stem: Path, result: Result, settings: Settings) -> Path:
    """<stem>.json (the metrics and how they were measured) and <stem>.answers.jsonl; the answers file."""
    record = {"target": result.target, "model": result.label, "data": settings.data, "metrics": result.metrics,
              "tasks": result.tasks, "extract": settings.extract, "max_new_tokens": settings.max_new_tokens,
              "examples": len(result.answers), "at": time.time()}
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_name(stem.name + ".json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    answers = stem.with_name(stem.name + ".answers.jsonl")
    with open(answers, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(answer, ensure_ascii=False) + "\n" for answer in result.answers)
    return answers


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "model"


def saved_results(run: Path) -> list[dict]:
    """The evaluation records kept in a run folder, oldest first."""
    folder = Path(run) / EVAL_FOLDER
    records = [json.loads(path.read_text(encoding="utf-8")) for path in folder.glob("*.json")] \
        if folder.is_dir() else []
    return sorted(records, key=lambda record: record.get("at", 0))


def table(results: list[Result]) -> str:
    """A Markdown table: one row per metric, one column per target."""
    names = [name for name in (*ALWAYS[:2], *METRICS, *ALWAYS[2:])
             if any(name in r.metrics for r in results)]
    names += sorted({task for r in results for task in r.tasks})
    header = "| metric | " + " | ".join(r.target for r in results) + " |"
    lines = [header, "|---|" + "---|" * len(results)]
    for name in names:
        cells = [shown_value(name, {**r.metrics, **r.tasks}.get(name)) for r in results]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def shown_value(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name in ("exact_match", "contains", "stop_rate"):
        return f"{100 * value:.1f}%"
    if name == "mean_length":
        return f"{value:.1f}"
    return f"{value:.4f}" if name in ("loss", "rouge_l") or "/" in name else f"{value:.2f}"
