"""The Gradio panel: launch runs, watch them live, compare them, chat with checkpoints, export.

`build_app(workspace)` only builds the Blocks; nothing starts, loads or writes until a page asks. Training, chat and
export run in other processes (runs as `finetune train` in their own process group, chat in a ChatWorker, exports as
`finetune export`), so this process never imports torch, transformers or unsloth.
"""

from __future__ import annotations

import shlex

import gradio as gr
import pandas as pd

from finetune import run_folder
from finetune.mlflow_store import recorded
from finetune.trained.evaluate import DEFAULT_METRICS, METRICS, shown_value
from finetune.ui.chat_models import ChatModels
from finetune.ui.workspace import FIELDS, RAY_PREFIX, PanelError, RunInfo, Workspace

ONE_PROCESS = "one process (finetune train)"
THIS_CPU = "this machine's CPU"
GPU_CHOICES = [THIS_CPU, "a10", "l4", "a100-40", "a100-80", "h100", "h200"]
CSS = """
.status-card {border-radius: 10px; padding: 10px 14px; background: var(--block-background-fill);}
.field-error {color: var(--error-text-color, #b91c1c); font-size: 0.9em;}
footer {display: none !important;}
"""


def build_app(workspace: Workspace, models: ChatModels | None = None) -> gr.Blocks:
    models = models or ChatModels()

    with gr.Blocks(title="finetune") as app:
        gr.Markdown(f"# finetune\nWorkspace `{workspace.root}` · runs keep going when this page or the panel closes.")

        with gr.Tab("Train"):
            with gr.Row():
                recipe = gr.Dropdown(workspace.recipe_names(), label="Recipe", value="quickstart", scale=2)
                upload = gr.UploadButton("Upload a recipe (YAML)", file_types=[".yaml", ".yml"], scale=1)
                launcher = gr.Dropdown([ONE_PROCESS, *map(_launcher_choice, workspace.launchers())],
                                       value=ONE_PROCESS, label="Launch with", scale=1)
            with gr.Row():
                run_name = gr.Textbox(label="Run name", placeholder="empty: a fresh run-DATE-TIME")
                fields = {label: gr.Dropdown(STAGE_CHOICES, value="", label=label) if label == "stage"
                          else gr.Textbox(label=label) for label in FIELDS}
            extra = gr.Textbox(label="More settings (key=value, one per line)", lines=2,
                               placeholder="train.max_steps=200\ntrain.per_device_train_batch_size=4")
            with gr.Row():
                validate_button = gr.Button("Validate")
                launch_button = gr.Button("Launch", variant="primary")
            train_message = gr.Markdown()
            field_errors = gr.Markdown(elem_classes="field-error")
            command_view = gr.Code(label="Command", language="shell", interactive=False, lines=3, max_lines=12)
            with gr.Row():
                gpu = gr.Dropdown(GPU_CHOICES, value=THIS_CPU, label="Plan memory for", scale=1)
                plan_button = gr.Button("Plan memory", scale=1)
            memory = gr.Code(label="Memory plan per device (finetune estimate)", language=None, interactive=False,
                             lines=6, max_lines=20)
            with gr.Accordion("Validation report", open=False) as report:
                validation = gr.Code(label="Validation", language="yaml", interactive=False, lines=8, max_lines=30)

        with gr.Tab("Live"):
            with gr.Row():
                live_run = gr.Dropdown(label="Run", choices=[], scale=3, allow_custom_value=True)
                stop_button = gr.Button("Stop", variant="stop", scale=1)
                resume_button = gr.Button("Resume", scale=1)
            live_status = gr.Markdown(elem_classes="status-card")
            with gr.Row():
                loss_plot = gr.LinePlot(x="step", y="loss", title="Loss", y_title="loss", y_axis_format=".3f",
                                        height=260)
                lr_plot = gr.LinePlot(x="step", y="learning_rate", title="Learning rate", y_title="learning rate",
                                      y_axis_format=".1e", height=260)
            stage_plot = gr.LinePlot(x="step", y="value", color="metric", title="Rewards (DPO, KTO, GRPO)",
                                     y_title="value", y_axis_format=".3f", height=260)
            samples_view = gr.Dataframe(label="Answers to held-out prompts at the last two evaluations (eval.samples; "
                                        "… ran to the token limit)", interactive=False, wrap=True)
            log_tail = gr.Code(label="Log", language="shell", interactive=False, lines=12)

        with gr.Tab("Runs"):
            runs_table = gr.Dataframe(interactive=False, wrap=True)
            compare = gr.Dropdown(label="Overlay the loss curves of", multiselect=True, choices=[], allow_custom_value=True)
            compare_plot = gr.LinePlot(x="step", y="loss", color="run", title="Loss", height=300, y_axis_format=".3f")

        with gr.Tab("Chat"):
            with gr.Row():
                chat_run = gr.Dropdown(label="Run", choices=[], allow_custom_value=True)
                chat_checkpoint = gr.Dropdown(label="Checkpoint", choices=[], allow_custom_value=True)
                side_by_side = gr.Checkbox(label="Answer with the base model too", value=False)
            with gr.Row():
                system = gr.Textbox(label="System prompt", scale=3)
                temperature = gr.Slider(0, 1.5, value=0.7, step=0.05, label="Temperature")
                max_new_tokens = gr.Slider(16, 2048, value=256, step=16, label="Max new tokens")
            with gr.Row():
                tuned_chat = gr.Chatbot(label="Fine-tuned", height=380)
                base_chat = gr.Chatbot(label="Base model", height=380, visible=False)
            message = gr.Textbox(label="Message", placeholder="Write a message and press Enter")
            chat_notice = gr.Markdown()

        with gr.Tab("Evaluate"):
            with gr.Row():
                eval_targets = gr.Dropdown(label="Models (runs, checkpoints, base models)", multiselect=True,
                                           choices=[], allow_custom_value=True, scale=3)
                eval_data = gr.Dropdown(label="Data (files in data/, or builtin)", choices=workspace.data_names(),
                                        value=workspace.data_names()[0], scale=2)
            with gr.Row():
                eval_metrics = gr.CheckboxGroup(list(METRICS), value=list(DEFAULT_METRICS), label="Metrics")
                eval_tokens = gr.Slider(16, 1024, value=128, step=16, label="Max new tokens")
                eval_limit = gr.Number(value=50, precision=0, label="First N examples (0: all)")
            eval_button = gr.Button("Evaluate", variant="primary")
            eval_message = gr.Markdown()
            eval_table = gr.Dataframe(label="Side by side (loss, perplexity and stop rate are always measured)",
                                      interactive=False)
            eval_answers = gr.Dataframe(label="Answers, example by example (… ran to the token limit)",
                                        interactive=False, wrap=True)

        with gr.Tab("Export"):
            with gr.Row():
                export_run = gr.Dropdown(label="Run", choices=[], allow_custom_value=True)
                export_checkpoint = gr.Dropdown(label="Checkpoint", choices=[], allow_custom_value=True)
                export_name = gr.Textbox(label="Export name (under exports/)")
            with gr.Row():
                merge = gr.Checkbox(label="Merge into the base (16-bit)")
                dtype = gr.Radio(["bf16", "fp16", "fp32"], value="bf16", label="Merged dtype")
                push_repo = gr.Textbox(label="Push to Hub repository (optional)", placeholder="you/model-name")
                private = gr.Checkbox(label="Private", value=True)
            token_state = gr.Markdown(_token_line())
            export_button = gr.Button("Export", variant="primary")
            export_result = gr.Code(label="Result", language="shell", interactive=False, lines=6)

        timer = gr.Timer(2.0)

        # Train
        def fill_fields(name):
            try:
                values = workspace.recipe_fields(name)
            except PanelError as error:
                return [gr.update()] * len(FIELDS) + [f"⚠ {error}"]
            return [gr.update(value="" if values[label] is None else str(values[label])) for label in FIELDS] + [""]

        def overrides_of(*values):
            *field_values, extra_text = values
            overrides = [f"{FIELDS[label]}={value.strip()}" for label, value in zip(FIELDS, field_values)
                         if value and value.strip()]
            for line in (extra_text or "").splitlines():
                if line.strip():
                    if "=" not in line:
                        raise PanelError(f"more settings: {line.strip()!r} is not key=value")
                    overrides.append(line.strip())
            return overrides

        def preview(recipe_name, launch_with, name, *values):
            name = name.strip() or workspace.free_run_name()
            try:
                command = workspace.command(recipe_name, overrides_of(*values), name, _accelerate(launch_with))
            except PanelError as error:
                return f"# {error}"
            return _shell_lines(["finetune", *command[3:]])

        def validate(recipe_name, launch_with, name, *values):
            name = name.strip() or workspace.free_run_name()
            try:
                ok, text = workspace.validate(recipe_name, overrides_of(*values), name)
            except PanelError as error:
                return "", f"⚠ {error}", "", gr.update()
            if ok:
                return text, "✓ The recipe and its data are valid.", "", gr.update(open=True)
            return text, f"⚠ {text.removeprefix('error: ')}", _field_error(text), gr.update(open=False)

        def launch(recipe_name, launch_with, name, *values):
            name = name.strip() or workspace.free_run_name()  # typed names are never replaced under the user
            try:
                overrides = overrides_of(*values)
                ok, text = workspace.validate(recipe_name, overrides, name)
                if not ok:
                    return (text, f"⚠ Not launched: {text.removeprefix('error: ')}", _field_error(text),
                            gr.update(), gr.update())
                command = workspace.command(recipe_name, overrides, name, _accelerate(launch_with))
                unloaded = models.release_all()  # the run's processes get the GPU memory chat models held
                workspace.launch(command, name)
            except PanelError as error:
                return "", f"⚠ {error}", "", gr.update(), gr.update()
            note = f" (unloaded {unloaded} chat model{'s' if unloaded > 1 else ''} to free its memory)" if unloaded else ""
            return (text, f"✓ Launched **{name}**{note}: follow it in the Live tab.", "",
                    gr.update(choices=_run_names(workspace), value=name), "")  # the next Launch: a fresh name

        def plan_memory(recipe_name, launch_with, gpu_choice, name, *values):
            try:
                return workspace.estimate(recipe_name, overrides_of(*values), _accelerate(launch_with),
                                          None if gpu_choice == THIS_CPU else gpu_choice)
            except PanelError as error:
                return f"{error}"

        def uploaded(file):
            if file is None:
                return gr.update(), ""
            try:
                with open(file, encoding="utf-8") as handle:
                    name = workspace.save_recipe(file.rsplit("/", 1)[-1], handle.read())
            except (PanelError, UnicodeDecodeError) as error:
                return gr.update(), f"⚠ {error}"
            return gr.update(choices=workspace.recipe_names(), value=name), f"Saved as `{name}`; validate it next."

        train_inputs = [recipe, launcher, run_name, *fields.values(), extra]
        recipe.change(fill_fields, recipe, [*fields.values(), train_message])
        upload.upload(uploaded, upload, [recipe, train_message])
        for component in train_inputs:
            component.change(preview, train_inputs, command_view, show_progress="hidden")
        validate_button.click(validate, train_inputs, [validation, train_message, field_errors, report],
                              api_name="validate")
        launch_button.click(launch, train_inputs, [validation, train_message, field_errors, live_run, run_name],
                            api_name="launch")
        plan_inputs = [recipe, launcher, gpu, run_name, *fields.values(), extra]
        plan_button.click(plan_memory, plan_inputs, memory, api_name="plan")
        gpu.change(plan_memory, plan_inputs, memory)
        app.load(fill_fields, recipe, [*fields.values(), train_message])
        app.load(preview, train_inputs, command_view)

        # Live
        def live(name):
            if not name:
                return "No run selected.", None, None, None, "", None
            try:
                info = workspace.run(name)
            except PanelError as error:
                return f"⚠ {error}", None, None, None, "", None
            # float columns even while empty: a plot's first frame fixes its axes' types
            frame = pd.DataFrame(info.train_rows, columns=["step", "loss", "learning_rate"]).astype(float)
            return (_status_card(info), frame, frame, pd.DataFrame(info.samples) if info.samples else None,
                    workspace.console_tail(name), _stage_frame(info.train_rows))

        def stop(name):
            if not name:
                return "No run selected."
            try:
                how = workspace.stop(name)
            except PanelError as error:
                return f"⚠ {error}"
            return _status_card(workspace.run(name)) + f"\n\nStop: {how}."

        def resume(name):
            if not name:
                return "No run selected."
            try:
                unloaded = models.release_all()
                workspace.resume(name)
            except PanelError as error:
                return f"⚠ {error}"
            note = f" (unloaded {unloaded} chat model{'s' if unloaded > 1 else ''})" if unloaded else ""
            return _status_card(workspace.run(name)) + f"\n\nResumed from its newest complete checkpoint{note}."

        live_outputs = [live_status, loss_plot, lr_plot, samples_view, log_tail, stage_plot]
        live_run.change(live, live_run, live_outputs, api_name="progress")
        timer.tick(live, live_run, live_outputs, show_progress="hidden")
        timer.tick(models.release_idle, None, None, show_progress="hidden")
        stop_button.click(stop, live_run, live_status, api_name="stop")
        resume_button.click(resume, live_run, live_status, api_name="resume")

        # Runs
        def runs_overview(selected):
            infos = workspace.runs_list()
            selected = selected or [info.name for info in infos[:3]]  # the latest runs until the user picks
            table = pd.DataFrame([_row(info) for info in infos],
                                 columns=["run", "status", "steps", "duration", "final loss", "tokens/s"])
            curves = pd.DataFrame(
                [{"run": info.name, "step": row["step"], "loss": row["loss"]}
                 for info in infos if info.name in (selected or []) for row in info.train_rows],
                columns=["run", "step", "loss"]).astype({"step": float, "loss": float})
            names = [info.name for info in infos]
            return table, gr.update(choices=names), curves

        runs_outputs = [runs_table, compare, compare_plot]
        timer.tick(runs_overview, compare, runs_outputs, show_progress="hidden", api_name="runs")
        compare.change(runs_overview, compare, runs_outputs)
        app.load(runs_overview, compare, runs_outputs)

        def refresh_run_choices(current_live, current_chat, current_export):
            names = _run_names(workspace)
            return [gr.update(choices=names, value=current or (names[0] if names else None))
                    for current in (current_live, current_chat, current_export)]

        app.load(refresh_run_choices, [live_run, chat_run, export_run], [live_run, chat_run, export_run])
        timer.tick(lambda: [gr.update(choices=_run_names(workspace))] * 3, None, [live_run, chat_run, export_run],
                   show_progress="hidden")

        # Chat
        def checkpoints_of(name):
            try:
                found = workspace.checkpoints(name) if name else []
            except PanelError:
                found = []
            return gr.update(choices=found, value=found[0] if found else None)

        chat_run.change(checkpoints_of, chat_run, chat_checkpoint)
        export_run.change(checkpoints_of, export_run, export_checkpoint)
        side_by_side.change(lambda on: gr.update(visible=on), side_by_side, base_chat)

        def send(text, run, checkpoint, system_prompt, temp, max_tokens, both, tuned_history, base_history,
                 request: gr.Request):
            from finetune.errors import UserError
            from finetune.trained.chat import Piece, Sampling

            if not text.strip():
                yield tuned_history, base_history, "", ""
                return
            try:
                folder = workspace.model_folder(run, checkpoint)
            except PanelError as error:
                yield tuned_history, base_history, text, f"⚠ {error}"
                return
            sampling = Sampling(max_new_tokens=int(max_tokens), temperature=float(temp))
            histories = {False: list(tuned_history or []), True: list(base_history or [])}
            sides = [False, True] if both else [False]
            conversations = {}
            for base in sides:  # the question shows in every chat at once; answers follow one model at a time
                earlier = [{"role": m["role"], "content": _text(m["content"])} for m in histories[base]
                           if not m.get("metadata")]  # reasoning bubbles are display only
                system_turn = [{"role": "system", "content": system_prompt}] if system_prompt else []
                conversations[base] = [*system_turn, *earlier, {"role": "user", "content": text}]
                histories[base].append({"role": "user", "content": text})
            yield histories[False], histories[True], "", ""
            for base in sides:
                shown = {}  # kind -> the bubble it streams into
                try:
                    for item in models.get(request.session_hash, folder, base).stream(conversations[base], sampling):
                        if isinstance(item, Piece):
                            if item.kind not in shown:
                                shown[item.kind] = {"role": "assistant", "content": ""}
                                if item.kind == "thinking":
                                    shown[item.kind]["metadata"] = {"title": "Reasoning", "status": "done"}
                                histories[base].append(shown[item.kind])
                            shown[item.kind]["content"] += item.text
                            yield histories[False], histories[True], "", ""
                except (UserError, RuntimeError) as error:
                    yield histories[False], histories[True], "", f"⚠ {error}"
                    return
                if "answer" not in shown:
                    histories[base].append({"role": "assistant", "content": ""})
            yield histories[False], histories[True], "", ""

        message.submit(send, [message, chat_run, chat_checkpoint, system, temperature, max_new_tokens, side_by_side,
                              tuned_chat, base_chat], [tuned_chat, base_chat, message, chat_notice], api_name="chat")

        def session_closed(request: gr.Request):
            models.release_session(request.session_hash)

        app.unload(session_closed)

        # Evaluate
        def evaluate(targets, data, metrics, max_tokens, limit):
            yield "Evaluating (the models load in their own process) …", None, None
            try:
                table, answers, _ = workspace.evaluate(targets or [], data, metrics or [], max_tokens, limit or None)
            except PanelError as error:
                yield f"⚠ {error}", None, None
                return
            shown = pd.DataFrame([{"metric": row["metric"], **{target: shown_value(row["metric"], value)
                                                              for target, value in row.items() if target != "metric"}}
                                  for row in table])
            yield f"Evaluated {len(targets)} model{'s' if len(targets) > 1 else ''} on {len(answers)} examples.", \
                shown, pd.DataFrame(answers)

        eval_button.click(evaluate, [eval_targets, eval_data, eval_metrics, eval_tokens, eval_limit],
                          [eval_message, eval_table, eval_answers], api_name="evaluate")
        app.load(lambda: gr.update(choices=workspace.eval_targets()), None, eval_targets)
        timer.tick(lambda: gr.update(choices=workspace.eval_targets()), None, eval_targets, show_progress="hidden")

        # Export
        def export(run, checkpoint, name, merged, weights, repo, is_private):
            try:
                return workspace.export(run, checkpoint, name, merged, weights, repo, is_private), _token_line()
            except PanelError as error:
                return f"# {error}", _token_line()

        export_button.click(export, [export_run, export_checkpoint, export_name, merge, dtype, push_repo, private],
                            [export_result, token_state], api_name="export")
    return app


def _shell_lines(command: list[str]) -> str:
    """The command as a shell line per setting: `finetune train RECIPE`, then each override and option."""
    lines, rest = [shlex.join(command[:3])], command[3:]
    while rest:
        take = 2 if rest[0].startswith("--") and len(rest) > 1 else 1
        lines.append(shlex.join(rest[:take]))
        rest = rest[take:]
    return " \\\n    ".join(lines)


def _accelerate(choice: str) -> str | None:
    return None if choice == ONE_PROCESS else choice


STAGE_CHOICES = [("as in the recipe", ""), ("sft: supervised", "sft"), ("dpo: preference pairs", "dpo"),
                 ("kto: labelled answers", "kto"), ("grpo: rewards", "grpo")]


def _stage_frame(rows: list[dict]) -> pd.DataFrame | None:
    """DPO's and KTO's reward margins and accuracies, GRPO's rewards, one line per metric; None for SFT."""
    points = [{"step": float(row["step"]), "metric": key, "value": float(value)}
              for row in rows for key, value in row.items() if run_folder.plotted_stage_metric(key)]
    return pd.DataFrame(points) if points else None


def _launcher_choice(name: str) -> tuple[str, str]:
    """(label, value) of a launcher: an accelerate config by its name, `ray:N` as Ray Train with N workers."""
    workers = name.removeprefix(RAY_PREFIX)
    return (f"Ray Train, {workers} workers", name) if name.startswith(RAY_PREFIX) else (name, name)


def _run_names(workspace: Workspace) -> list[str]:
    return [info.name for info in workspace.runs_list()]


def _field_error(message: str) -> str:
    """The field a validation message is about, when it names one of the Train tab's keys."""
    for label, key in FIELDS.items():
        if key in message:
            return f"⚠ **{label}** (`{key}`): {message.removeprefix('error: ')}"
    return ""


def _text(content) -> str:
    """A chatbot message's text (Gradio hands content back as a list of typed parts)."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def _status_card(info: RunInfo) -> str:
    color = {"running": "#16a34a", "starting": "#ca8a04", "completed": "#2563eb", "stopped": "#6b7280",
             "failed": "#dc2626"}.get(info.status, "#6b7280")
    icon = f'<span style="color:{color}">●</span>'
    last = info.last
    parts = [f"### {icon} {info.name} · {info.status}"]
    if last:
        parts.append(" · ".join([
            f"step **{last['step']}**" + (f" / {last['total_steps']}" if last.get("total_steps") else ""),
            f"loss **{last['loss']:.4f}**",
            f"**{last.get('tokens_per_second', 0):,.0f}** tokens/s",
            f"ETA **{_duration(info.eta_s)}**" if info.eta_s is not None else f"elapsed {_duration(info.duration_s)}",
            f"peak memory **{last.get('peak_memory_gb', 0):.2f} GB**",
        ]))
    if info.status == "failed" and info.rows and info.rows[-1].get("error"):
        parts.append(f"Error: `{info.rows[-1]['error']}`")
    mlflow = recorded(info.rows)
    if mlflow:
        parts.append(f"MLflow run `{mlflow['run_id']}` · open it with `{mlflow['open']}`")
    if info.resumable:
        parts.append("**Resume** continues it from its newest complete checkpoint.")
    return "\n\n".join(parts)


def _row(info: RunInfo) -> dict:
    last = info.last
    return {"run": info.name, "status": info.status, "steps": last.get("step", 0), "duration": _duration(info.duration_s),
            "final loss": round(last["loss"], 4) if "loss" in last else None,
            "tokens/s": round(last.get("tokens_per_second", 0))}


def _token_line() -> str:
    from huggingface_hub import get_token

    return ("Hub token: configured (never shown)." if get_token() else
            "Hub token: not configured — run `hf auth login` or set HF_TOKEN to push.")
