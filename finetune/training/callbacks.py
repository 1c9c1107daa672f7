"""The callbacks a run adds to its trainer: progress.jsonl rows (and through them MLflow), and answers to held-out
prompts at each evaluation."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback

from finetune.plan.time_plan import format_duration
from finetune.run_folder import EVAL_KEYS, RunFolder, eta_s, is_stage_metric, planned, planned_left_s, read_rows

logger = logging.getLogger("finetune")


class ProgressCallback(TrainerCallback):
    """Writes a progress.jsonl row at every logging step and every evaluation (main process only), and hands each
    row to `also` (the MLflow tracking), if given."""

    def __init__(self, trainer_elapsed, run_folder: RunFolder, tokens: int = 0, also=None):
        self.elapsed, self.run_folder, self.also = trainer_elapsed, run_folder, also
        self.last_time, self.last_tokens = time.monotonic(), tokens
        self.plan: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.plan = planned(read_rows(self.run_folder.path))  # the time plan the run made at its start

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        now = time.monotonic()
        row: dict[str, Any] = {"step": state.global_step, "epoch": round(state.epoch or 0.0, 4)}
        if "loss" in logs:
            tokens = int(logs.get("num_tokens", 0))
            row.update(
                loss=logs["loss"],
                learning_rate=logs.get("learning_rate"),
                grad_norm=logs.get("grad_norm"),
                tokens_per_second=round((tokens - self.last_tokens) / max(now - self.last_time, 1e-9), 1),
                tokens=tokens,
                trained_tokens=int(logs.get("trained_tokens", 0)),
                total_steps=state.max_steps,
            )
            self.last_time, self.last_tokens = now, tokens
        row.update({key: logs[key] for key in EVAL_KEYS if key in logs})
        row.update({key: logs[key] for key in logs if is_stage_metric(key)})
        if len(row) == 2:
            return  # the end-of-training summary: the status line says it
        row.update(peak_memory_gb=round(peak_memory_gb(), 3), elapsed_s=round(self.elapsed(), 2))
        self.write(row)
        line = console_line(row, state.max_steps, self.plan)
        logger.info(line)
        tqdm.write(line, file=sys.stdout)  # above the training bar, where a terminal shows one

    def write(self, row: dict[str, Any]) -> None:
        self.run_folder.append(row)
        if self.also is not None:
            self.also(row)


def console_line(row: dict[str, Any], total: int, plan: dict | None) -> str:
    """A progress row as a person reads it: step 40/2,230 | loss 1.234 | eval loss 1.100 | lr 9.98e-04 |
    1,234 tokens/s | 0.81 GB | ETA 3m10s (planned 3m05s). progress.jsonl keeps the row itself."""
    parts = [f"step {row['step']:,}/{total:,}"]
    if "loss" in row:
        parts.append(f"loss {row['loss']:.4g}")
    if "eval_loss" in row:
        parts.append(f"eval loss {row['eval_loss']:.4g}")
    if row.get("learning_rate") is not None:
        parts.append(f"lr {row['learning_rate']:.3g}")
    if row.get("tokens_per_second"):
        parts.append(f"{row['tokens_per_second']:,.0f} tokens/s")
    parts.append(f"{row['peak_memory_gb']:.2f} GB")
    left = eta_s(row) if "loss" in row else None
    if left is not None:
        plan_left = planned_left_s(plan, row["step"])
        parts.append(f"ETA {format_duration(left)}"
                     + (f" (planned {format_duration(plan_left)})" if plan_left is not None else ""))
    return " | ".join(parts)


def peak_memory_gb() -> float:
    """Peak accelerator memory of this process where there is one, else its peak resident memory."""
    import resource

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    kilobytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kilobytes / (2**20 if sys.platform != "darwin" else 2**30)


class SamplesCallback(TrainerCallback):
    """At every evaluation, greedy answers to the first held-out prompts (eval.samples), recorded as a progress row
    {"step", "samples": [{prompt, answer, reference, stopped}], "samples_stop_rate"}. Every process generates (a
    sharded model needs all of them to); the main one records."""

    def __init__(self, examples: list, tokenizer, renderer, max_new_tokens: int, record):
        self.examples, self.tokenizer, self.renderer = examples, tokenizer, renderer
        self.max_new_tokens, self.record = max_new_tokens, record

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        from finetune.trained_model.chat import Chat
        from finetune.trained_model.evaluate import answer_rows

        training = model.training
        model.eval()
        try:
            rows = answer_rows(Chat.of(model, self.tokenizer, self.renderer), self.examples, self.max_new_tokens,
                               batch_size=len(self.examples), synced=args.world_size > 1)
        finally:
            model.train(training)
        if state.is_world_process_zero:
            samples = [{key: row[key] for key in ("prompt", "answer", "reference", "stopped")} for row in rows]
            self.record({"step": state.global_step, "samples": samples,
                         "samples_stop_rate": sum(row["stopped"] for row in rows) / len(rows)})
