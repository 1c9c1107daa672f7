"""The Gradio panel: launch runs, watch them live, compare them, chat with checkpoints, evaluate, export.

`build_app(workspace)` only builds the Blocks; nothing starts, loads or writes until a page asks. Training, chat,
evaluation and export run in other processes (runs as `finetune train` in their own process group, chat in a
ChatWorker, evaluations and exports as `finetune eval` and `finetune export`), so this process never imports torch,
transformers or unsloth. Each tab is a module with its layout and its handlers; this one puts them together.
"""

from __future__ import annotations

import gradio as gr

from finetune.ui import chat_tab, evaluate_tab, export_tab, live_tab, runs_tab, train_tab
from finetune.ui.chat_models import ChatModels
from finetune.ui.workspace import Workspace

CSS = """
.status-card {border-radius: 10px; padding: 10px 14px; background: var(--block-background-fill);}
.field-error {color: var(--error-text-color, #b91c1c); font-size: 0.9em;}
footer {display: none !important;}
"""
REFRESH_S = 2.0


def build_app(workspace: Workspace, models: ChatModels | None = None) -> gr.Blocks:
    models = models or ChatModels()
    with gr.Blocks(title="finetune") as app:
        gr.Markdown(f"# finetune\nWorkspace `{workspace.root}` · runs keep going when this page or the panel closes.")
        timer = gr.Timer(REFRESH_S)
        live_run = gr.Dropdown(label="Run", choices=[], scale=3, allow_custom_value=True, render=False)
        with gr.Tab("Train"):
            train_tab.build(app, workspace, models, live_run)
        with gr.Tab("Live"):
            live_tab.build(workspace, models, timer, live_run)
        with gr.Tab("Runs"):
            runs_tab.build(app, workspace, timer)
        with gr.Tab("Chat"):
            chat_run = chat_tab.build(app, workspace, models)
        with gr.Tab("Evaluate"):
            evaluate_tab.build(app, workspace, timer)
        with gr.Tab("Export"):
            export_run = export_tab.build(workspace)

        pickers = [live_run, chat_run, export_run]

        def refresh_pickers(*current):
            names = workspace.run_names()
            return [gr.update(choices=names, value=value or (names[0] if names else None)) for value in current]

        app.load(refresh_pickers, pickers, pickers)
        timer.tick(lambda: [gr.update(choices=workspace.run_names())] * len(pickers), None, pickers,
                   show_progress="hidden")
        timer.tick(models.release_idle, None, None, show_progress="hidden")
    return app
