"""What one normalized example becomes for each stage's trainer, with the same exact masks as SFT.

    sft    {input_ids, labels}: the rendered example, labels -100 where no loss
    dpo    {prompt_ids, chosen_ids, rejected_ids}: TRL's DPO columns
    kto    {prompt_ids, completion_ids, label}: TRL's KTO columns
    grpo   {prompt, answer}: the conversation before the last assistant turn, which GRPO answers, and that turn's
           text, the reference the rewards compare with

An answer's ids are exactly the tokens that carry loss when the prompt and that answer are rendered as an SFT
example (Renderer.encode): the answer's tokens through its end-of-turn token, never the prompt or template glue; the
prompt ids are everything before them, which must be the same for both answers of a pair.
"""

from __future__ import annotations

from typing import Any

from finetune.data.formats import BadRow
from finetune.data.render import IGNORE, Renderer


def answer_example(example: dict[str, Any]) -> dict[str, Any]:
    """The SFT-shaped example of any stage's example: a pair's chosen one, a labelled answer's."""
    return example.get("chosen") or example.get("completion") or example


class RowEncoder:
    def __init__(self, renderer: Renderer, stage: str):
        self.renderer, self.stage = renderer, stage

    def features(self):
        import datasets

        ids = datasets.Sequence(datasets.Value("int32"))  # any vocabulary's ids, and -100: half int64's disk
        return datasets.Features({
            "sft": {"input_ids": ids, "labels": ids},
            "dpo": {"prompt_ids": ids, "chosen_ids": ids, "rejected_ids": ids},
            "kto": {"prompt_ids": ids, "completion_ids": ids, "label": datasets.Value("bool")},
            "grpo": {"prompt": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
                     "answer": datasets.Value("string"), "prompt_length": datasets.Value("int64")},
        }[self.stage])

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        """The example's row for the stage; BadRow when it has none."""
        if self.stage == "sft":
            ids, labels = self.renderer.encode(example)
            return {"input_ids": ids, "labels": labels}
        if self.stage == "grpo":
            return self._prompt_row(example)
        if self.stage == "dpo" and "chosen" not in example:
            raise BadRow("stage dpo needs a chosen and a rejected answer")
        if self.stage == "kto":
            prompt, completion = self._split(example["completion"], "completion")
            return {"prompt_ids": prompt, "completion_ids": completion, "label": example["label"]}
        prompt, chosen = self._split(example["chosen"], "chosen")
        rejected_prompt, rejected = self._split(example["rejected"], "rejected")
        if rejected_prompt != prompt:
            thinking = any(message.get("thinking") for answer in (example["chosen"], example["rejected"])
                           for message in answer["messages"])
            why = ("; with data.train_thinking: false the answers' reasoning (thinking) is prompt, not answer: set "
                   "it true" if thinking and not self.renderer.train_thinking else "")
            raise BadRow(f"chosen and rejected render different prompts{why}")
        return {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}

    def _split(self, example: dict[str, Any], name: str) -> tuple[list[int], list[int]]:
        """(prompt ids, answer ids): the answer is the span of tokens that carry loss."""
        ids, labels = self.renderer.encode(example)
        trained = [i for i, label in enumerate(labels) if label != IGNORE]
        start, end = trained[0], trained[-1] + 1
        if len(trained) != end - start:
            raise BadRow(f"{name}: the answer has turns between its assistant messages that carry no loss (tool "
                         "results); give one assistant answer")
        return ids[:start], ids[start:end]

    def _prompt_row(self, example: dict[str, Any]) -> dict[str, Any]:
        if "messages" not in example:
            raise BadRow("stage grpo answers conversations: give rows with messages (the last assistant turn is "
                         "the reference answer)")
        messages = example["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:last]]
        if any(m.get("tool_calls") or m.get("thinking") for m in messages[:last]):
            raise BadRow("stage grpo takes prompts of plain messages (no tool calls or thinking before the answer)")
        if not prompt:
            raise BadRow("no prompt before the assistant's answer")
        length = len(self.renderer.prompt_ids(prompt, example.get("tools")))
        return {"prompt": prompt, "answer": messages[last]["content"], "prompt_length": length}

    def fit(self, row: dict[str, Any], max_length: int) -> tuple[dict[str, Any] | None, bool]:
        """(the row within max_length tokens, or None when no answer token fits; whether it was cut). A pair is cut
        at the end of each answer (TRL's keep_start)."""
        if self.stage == "sft":
            if len(row["input_ids"]) <= max_length:
                return row, False
            cut = {key: value[:max_length] for key, value in row.items()}
            return (None if all(label == IGNORE for label in cut["labels"]) else cut), True
        if self.stage == "grpo":
            return (row if row["prompt_length"] < max_length else None), False
        room = max_length - len(row["prompt_ids"])
        if room <= 0:
            return None, True
        answers = [key for key in row if key.endswith("_ids") and key != "prompt_ids"]
        if all(len(row[key]) <= room for key in answers):
            return row, False
        return {**row, **{key: row[key][:room] for key in answers}}, True

    def counts(self, row: dict[str, Any]) -> tuple[int, int, int]:
        """(length, tokens, tokens that carry loss) of a row: a pair's length is its longer sequence, its tokens
        both sequences'."""
        if self.stage == "sft":
            labels = row["labels"]
            return len(labels), len(labels), len(labels) - labels.count(IGNORE)
        if self.stage == "grpo":
            return row["prompt_length"], row["prompt_length"], 0
        answers = [len(row[key]) for key in row if key.endswith("_ids") and key != "prompt_ids"]
        prompt = len(row["prompt_ids"])
        return prompt + max(answers), prompt * len(answers) + sum(answers), sum(answers)

    def marked(self, row: dict[str, Any], mark) -> str:
        """The row as text with its answer tokens marked by `mark(ids, labels)` (a pair: both answers)."""
        if self.stage == "sft":
            return mark(row["input_ids"], row["labels"])
        if self.stage == "grpo":
            ids = self.renderer.prompt_ids(row["prompt"])
            return mark(ids, [IGNORE] * len(ids)) + f"\n(reference: {row['answer']})"
        prompt = row["prompt_ids"]
        shown = []
        for key in ("chosen_ids", "rejected_ids", "completion_ids"):
            if key in row:
                name = key.removesuffix("_ids") if key != "completion_ids" else \
                    ("desirable" if row["label"] else "undesirable")
                shown.append(f"[{name}]\n" + mark(prompt + row[key], [IGNORE] * len(prompt) + row[key]))
        return "\n".join(shown)
