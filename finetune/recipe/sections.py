"""The recipe's own sections, each a dataclass whose fields are its keys, with their defaults and help: model, lora,
data, eval and mlflow (train: and the stages' sections follow TRL's configs: train_section.py, stage_sections.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class ModelSection:
    name_or_path: str | None = field(
        default=None, metadata={"help": "Hugging Face model id, local folder, or builtin:tiny-llama."}
    )
    backend: Literal["auto", "unsloth", "hf"] = field(
        default="auto", metadata={"help": "auto picks unsloth on a CUDA machine that has it, else hf."}
    )
    revision: str | None = field(default=None, metadata={"help": "Hub revision (branch, tag or commit)."})
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = field(
        default="auto", metadata={"help": "Weights dtype; auto follows the training precision."}
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "sdpa, eager, flash_attention_2, ...; default: the model's own choice."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the modeling code the model's repository ships (only for code you trust)."}
    )
    chat_template: str | None = field(
        default=None, metadata={"help": "Path to a .jinja chat template; default: the tokenizer's own."}
    )
    adapter: str | None = field(
        default=None, metadata={"help": "Continue training this LoRA adapter: a run folder (its final/), one of its "
                                        "checkpoints, or an adapter folder; e.g. DPO after SFT. name_or_path "
                                        "defaults to the adapter's base model."}
    )


@dataclass
class LoraSection:
    r: int = field(default=16, metadata={"help": "Adapter rank."})
    alpha: int = field(default=32, metadata={"help": "Scaling numerator (scale = alpha / r)."})
    dropout: float = field(default=0.0, metadata={"help": "Dropout on the adapter's input while training."})
    target_modules: str | list[str] = field(
        default="all-linear", metadata={"help": "Module names to adapt, or all-linear."}
    )
    target_parameters: list[str] | None = field(
        default=None,
        metadata={"help": "Parameters (not modules) to adapt, e.g. MoE experts: 7.mlp.experts.gate_up_proj."},
    )
    modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained in full and saved with the adapter (e.g. embed_tokens)."}
    )
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilized scaling: alpha / sqrt(r)."})
    use_dora: bool = field(default=False, metadata={"help": "DoRA: the weight's magnitude trained apart from its "
                                                            "direction."})


# The data formats rows come in: supervised ones, and the preference ones of stages dpo and kto (data/formats.py
# normalizes each)
FORMATS = ("messages", "alpaca", "sharegpt", "prompt_completion", "text")
PREFERENCE_FORMATS = ("preference", "sharegpt_preference", "hh", "kto")


@dataclass
class DataSection:
    train: str | list[str | dict[str, Any]] | None = field(
        default=None, metadata={"help": "JSONL/JSON/Parquet/CSV file, folder of them, Hub dataset name, or a list "
                                        "of them; a list entry {path: ..., rows: N | fraction: F | weight: W} "
                                        "takes a share of that source (a mixture)."}
    )
    eval: str | list[str] | None = field(default=None, metadata={"help": "Like train; or use eval_fraction."})
    prepared: str | None = field(
        default=None, metadata={"help": "Train from the data `finetune prepare` wrote to this folder (or URL: "
                                        "s3://, gs://, ... through fsspec), checked against this recipe's tokenizer, "
                                        "template and data settings (and data files, when data.train names them)."}
    )
    eval_fraction: float = field(default=0.0, metadata={"help": "Share of train rows held out for evaluation."})
    format: Literal[("auto", *FORMATS, *PREFERENCE_FORMATS)] = field(
        default="auto", metadata={"help": "auto detects it from the fields; preference, sharegpt_preference, hh and "
                                          "kto are for stages dpo and kto."})
    columns: dict[str, str] = field(
        default_factory=dict,
        metadata={"help": "Map the format's field names to your columns, e.g. {instruction: question}."},
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "System message for conversations that have none."}
    )
    loss_on: Literal["assistant", "all"] = field(
        default="assistant", metadata={"help": "Train on assistant turns only, or on every token."}
    )
    train_thinking: bool = field(
        default=True, metadata={"help": "Whether the reasoning of assistant turns (thinking) carries loss."}
    )
    thinking_marker: str | None = field(
        default=None,
        metadata={"help": "Split answers without thinking at the last occurrence of this text: what comes before "
                          "is the reasoning, what follows the answer (GSM8K: '####')."},
    )
    template_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Variables for the chat template, e.g. {reasoning_effort: high}."}
    )
    bad_rows: Literal["fail", "drop"] = field(
        default="fail", metadata={"help": "fail: stop and list them; drop: skip them and report the count."}
    )
    too_long: Literal["drop", "fail"] = field(
        default="drop", metadata={"help": "Rows whose tokens that carry loss all lie past train.max_length: drop "
                                          "them (the count is reported), or fail listing them."}
    )
    duplicates: Literal["report", "drop", "fail", "unchecked"] = field(
        default="report", metadata={"help": "Exact and near duplicate train rows, and train rows that duplicate an "
                                            "eval row: report them, drop them (the first of each group is kept), "
                                            "fail listing them, or leave them unchecked (large corpora)."}
    )
    near_duplicate_threshold: float = field(
        default=0.8, metadata={"help": "Rows whose word 3-grams have at least this Jaccard similarity are near "
                                       "duplicates."}
    )
    decontaminate: list[str] = field(
        default_factory=list, metadata={"help": "Evaluation sets no train row may overlap (13 words in common): "
                                                "data files, builtin:NAME, or lm-eval:TASK (an lm-evaluation-harness "
                                                "task whose data is local)."}
    )
    contaminated: Literal["fail", "drop", "report"] = field(
        default="fail", metadata={"help": "Train rows that overlap data.decontaminate: fail (above "
                                          "contamination_max_share), drop them, or report them."}
    )
    contamination_max_share: float = field(
        default=0.0, metadata={"help": "The share of train rows that may overlap data.decontaminate before "
                                       "contaminated=fail refuses."}
    )
    teaches_nothing: Literal["report", "drop", "fail"] = field(
        default="report", metadata={"help": "Rows that teach nothing (ending with another turn than the "
                                            "assistant's, a blank answer, reasoning the template leaves out): "
                                            "report, drop or fail."}
    )
    max_rows: int | None = field(default=None, metadata={"help": "Use only the first N rows of each split."})
    num_proc: int | None = field(
        default=None, metadata={"help": "Processes that render and tokenize the data; default: the cores, up to 8 "
                                        "(one for fewer than 2,000 rows). The result does not depend on it."}
    )
    template_date: str = field(
        default="2024-07-26",
        metadata={"help": "The date chat templates see (YYYY-MM-DD), fixed so renders are reproducible."},
    )


@dataclass
class EvalSection:
    samples: int = field(
        default=0, metadata={"help": "At every evaluation, also answer this many held-out prompts (the first of the "
                                     "eval split), greedily: written to progress.jsonl, TensorBoard and MLflow, and "
                                     "shown in the panel."}
    )
    max_new_tokens: int = field(default=128, metadata={"help": "The longest sample answer, in tokens."})


@dataclass
class MlflowSection:
    tracking_uri: str | None = field(
        default=None, metadata={"help": "Where runs are tracked with train.report_to [mlflow]: a server "
                                        "(http://HOST:5000) or a database URI; default: MLFLOW_TRACKING_URI, else "
                                        "mlflow.db (SQLite) in the workspace, beside runs/."}
    )
    experiment: str | None = field(
        default=None, metadata={"help": "The MLflow experiment; default: the recipe's name."}
    )
    log_model: bool = field(
        default=False, metadata={"help": "Also log the final model (the adapter) with its model card as artifacts."}
    )
