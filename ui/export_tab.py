"""The Export tab: a run's checkpoint as an adapter or a merged model under exports/, optionally pushed to the Hub
(`finetune export` in its own process)."""

from __future__ import annotations

import gradio as gr

from finetune.ui.chat_tab import checkpoints, picker
from finetune.ui.workspace import PanelError, Workspace


def export(workspace: Workspace, run: str, checkpoint: str, name: str, merge: bool, dtype: str, repo: str,
           private: bool) -> str:
    """What `finetune export` printed, or why the panel refused."""
    try:
        return workspace.export(run, checkpoint, name, merge, dtype, repo, private)
    except PanelError as error:
        return f"# {error}"


def token_line() -> str:
    from huggingface_hub import get_token

    return ("Hub token: configured (never shown)." if get_token() else
            "Hub token: not configured — run `hf auth login` or set HF_TOKEN to push.")


def build(workspace: Workspace) -> gr.Dropdown:
    """Lay out the tab and bind it; returns its run picker, which the app keeps up to date."""
    with gr.Row():
        run = gr.Dropdown(label="Run", choices=[], allow_custom_value=True)
        checkpoint = gr.Dropdown(label="Checkpoint", choices=[], allow_custom_value=True)
        name = gr.Textbox(label="Export name (under exports/)")
    with gr.Row():
        merge = gr.Checkbox(label="Merge into the base (16-bit)")
        dtype = gr.Radio(["bf16", "fp16", "fp32"], value="bf16", label="Merged dtype")
        repo = gr.Textbox(label="Push to Hub repository (optional)", placeholder="you/model-name")
        private = gr.Checkbox(label="Private", value=True)
    token_state = gr.Markdown(token_line())
    button = gr.Button("Export", variant="primary")
    result = gr.Code(label="Result", language="shell", interactive=False, lines=6)

    run.change(lambda name_: picker(checkpoints(workspace, name_)), run, checkpoint)
    button.click(lambda *values: (export(workspace, *values), token_line()),
                 [run, checkpoint, name, merge, dtype, repo, private], [result, token_state], api_name="export")
    return run
