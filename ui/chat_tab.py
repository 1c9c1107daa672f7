"""The Chat tab: talk to a run's checkpoint, optionally beside the base model it started from.

Answers stream as they are sampled, each model in its own process (ChatModels); a reasoning model's thinking shows
in a collapsed bubble of its own, which is never sent back to the model.
"""

from __future__ import annotations

from collections.abc import Iterator

import gradio as gr

from finetune.errors import UserError
from finetune.trained_model.chat import Piece, Sampling
from finetune.ui.chat_models import ChatModels
from finetune.ui.workspace import PanelError, Workspace

History = list[dict]


def checkpoints(workspace: Workspace, run: str | None) -> list[str]:
    try:
        return workspace.checkpoints(run) if run else []
    except PanelError:
        return []


def send(workspace: Workspace, models: ChatModels, session: str, text: str, run: str, checkpoint: str, system: str,
         sampling: Sampling, both: bool, tuned: History, base: History) -> Iterator[tuple[History, History, str, str]]:
    """Stream (tuned history, base history, what stays in the message box, a notice) as the answers come."""
    if not text.strip():
        yield tuned, base, "", ""
        return
    try:
        folder = workspace.model_folder(run, checkpoint)
    except PanelError as error:
        yield tuned, base, text, f"⚠ {error}"
        return
    histories = {False: list(tuned or []), True: list(base or [])}
    sides = [False, True] if both else [False]
    conversations = {}
    for side in sides:  # the question shows in every chat at once; answers follow one model at a time
        earlier = [{"role": m["role"], "content": message_text(m["content"])} for m in histories[side]
                   if not m.get("metadata")]  # reasoning bubbles are display only
        system_turn = [{"role": "system", "content": system}] if system else []
        conversations[side] = [*system_turn, *earlier, {"role": "user", "content": text}]
        histories[side].append({"role": "user", "content": text})
    yield histories[False], histories[True], "", ""
    for side in sides:
        shown = {}  # kind -> the bubble it streams into
        try:
            for item in models.get(session, folder, side).stream(conversations[side], sampling):
                if isinstance(item, Piece):
                    if item.kind not in shown:
                        shown[item.kind] = {"role": "assistant", "content": ""}
                        if item.kind == "thinking":
                            shown[item.kind]["metadata"] = {"title": "Reasoning", "status": "done"}
                        histories[side].append(shown[item.kind])
                    shown[item.kind]["content"] += item.text
                    yield histories[False], histories[True], "", ""
        except (UserError, RuntimeError) as error:
            yield histories[False], histories[True], "", f"⚠ {error}"
            return
        if "answer" not in shown:
            histories[side].append({"role": "assistant", "content": ""})
    yield histories[False], histories[True], "", ""


def message_text(content) -> str:
    """A chatbot message's text (Gradio hands content back as a list of typed parts)."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def build(app: gr.Blocks, workspace: Workspace, models: ChatModels) -> gr.Dropdown:
    """Lay out the tab and bind it; returns its run picker, which the app keeps up to date."""
    with gr.Row():
        run = gr.Dropdown(label="Run", choices=[], allow_custom_value=True)
        checkpoint = gr.Dropdown(label="Checkpoint", choices=[], allow_custom_value=True)
        side_by_side = gr.Checkbox(label="Answer with the base model too", value=False)
    with gr.Row():
        system = gr.Textbox(label="System prompt", scale=3)
        temperature = gr.Slider(0, 1.5, value=0.7, step=0.05, label="Temperature")
        max_new_tokens = gr.Slider(16, 2048, value=256, step=16, label="Max new tokens")
    with gr.Row():
        tuned_chat = gr.Chatbot(label="Fine-tuned", height=380)
        base_chat = gr.Chatbot(label="Base model", height=380, visible=False)
    message = gr.Textbox(label="Message", placeholder="Write a message and press Enter")
    notice = gr.Markdown()

    def on_send(text, run_name, checkpoint_name, system_prompt, temp, max_tokens, both, tuned, base,
                request: gr.Request):
        sampling = Sampling(max_new_tokens=int(max_tokens), temperature=float(temp))
        yield from send(workspace, models, request.session_hash, text, run_name, checkpoint_name, system_prompt,
                        sampling, both, tuned, base)

    run.change(lambda name: picker(checkpoints(workspace, name)), run, checkpoint)
    side_by_side.change(lambda on: gr.update(visible=on), side_by_side, base_chat)
    message.submit(on_send, [message, run, checkpoint, system, temperature, max_new_tokens, side_by_side, tuned_chat,
                             base_chat], [tuned_chat, base_chat, message, notice], api_name="chat")
    def on_page_closed(request: gr.Request):
        models.release_session(request.session_hash)

    app.unload(on_page_closed)
    return run


def picker(choices: list[str]) -> dict:
    """A dropdown update offering `choices`, the first one picked."""
    return gr.update(choices=choices, value=choices[0] if choices else None)
