"""The Evaluate tab: runs, checkpoints and base models side by side on one dataset, metric by metric and answer by
answer (`finetune eval` in its own process)."""

from __future__ import annotations

from collections.abc import Iterator

import gradio as gr
import pandas as pd

from finetune.trained_model.evaluate import DEFAULT_METRICS, METRICS, shown_value
from finetune.ui.workspace import PanelError, Workspace


def evaluate(workspace: Workspace, targets: list[str], data: str, metrics: list[str], max_new_tokens: int,
             limit: int | None) -> Iterator[tuple[str, pd.DataFrame | None, pd.DataFrame | None]]:
    """(a message, the metrics table, the answers table): first while it runs, then its results."""
    yield "Evaluating (the models load in their own process) …", None, None
    try:
        table, answers, _ = workspace.evaluate(targets, data, metrics, max_new_tokens, limit)
    except PanelError as error:
        yield f"⚠ {error}", None, None
        return
    shown = pd.DataFrame([{"metric": row["metric"], **{target: shown_value(row["metric"], value)
                                                      for target, value in row.items() if target != "metric"}}
                          for row in table])
    count = len(targets)
    yield f"Evaluated {count} model{'s' if count > 1 else ''} on {len(answers)} examples.", shown, pd.DataFrame(answers)


def build(app: gr.Blocks, workspace: Workspace, timer: gr.Timer) -> None:
    with gr.Row():
        targets = gr.Dropdown(label="Models (runs, checkpoints, base models)", multiselect=True, choices=[],
                              allow_custom_value=True, scale=3)
        data = gr.Dropdown(label="Data (files in data/, or builtin)", choices=workspace.data_names(),
                           value=workspace.data_names()[0], scale=2)
    with gr.Row():
        metrics = gr.CheckboxGroup(list(METRICS), value=list(DEFAULT_METRICS), label="Metrics")
        max_new_tokens = gr.Slider(16, 1024, value=128, step=16, label="Max new tokens")
        limit = gr.Number(value=50, precision=0, label="First N examples (0: all)")
    button = gr.Button("Evaluate", variant="primary")
    message = gr.Markdown()
    table = gr.Dataframe(label="Side by side (loss, perplexity and stop rate are always measured)", interactive=False)
    answers = gr.Dataframe(label="Answers, example by example (… ran to the token limit)", interactive=False,
                           wrap=True)

    def on_evaluate(chosen, data_name, chosen_metrics, tokens, first):
        yield from evaluate(workspace, chosen or [], data_name, chosen_metrics or [], tokens, first or None)

    button.click(on_evaluate, [targets, data, metrics, max_new_tokens, limit], [message, table, answers],
                 api_name="evaluate")
    app.load(lambda: gr.update(choices=workspace.eval_targets()), None, targets)
    timer.tick(lambda: gr.update(choices=workspace.eval_targets()), None, targets, show_progress="hidden")
