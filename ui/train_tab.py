"""The Train tab: pick a recipe, change its main settings, validate, plan memory, launch.

The handlers take the form's values and return plain values; `build` lays the tab out and binds them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import gradio as gr

from finetune.ui.chat_models import ChatModels, unloaded_note
from finetune.ui.workspace import FIELDS, RAY_PREFIX, PanelError, Workspace

ONE_PROCESS = "one process (finetune train)"
THIS_CPU = "this machine's CPU"
GPU_CHOICES = [THIS_CPU, "a10", "l4", "a100-40", "a100-80", "h100", "h200"]
STAGE_CHOICES = [("as in the recipe", ""), ("sft: supervised", "sft"), ("dpo: preference pairs", "dpo"),
                 ("kto: labelled answers", "kto"), ("grpo: rewards", "grpo")]


@dataclass
class Form:
    """What the Train tab's form says: the recipe, how to launch it, the run's name and its settings."""

    recipe: str
    launch_with: str  # ONE_PROCESS, an accelerate config's name, or ray:N
    run_name: str
    fields: dict[str, str]  # label (of FIELDS) -> the typed value, "" to keep the recipe's
    extra: str  # more settings, key=value per line

    def overrides(self) -> list[str]:
        overrides = [f"{FIELDS[label]}={value.strip()}" for label, value in self.fields.items()
                     if value and value.strip()]
        for line in (self.extra or "").splitlines():
            if line.strip():
                if "=" not in line:
                    raise PanelError(f"more settings: {line.strip()!r} is not key=value")
                overrides.append(line.strip())
        return overrides

    def accelerate(self) -> str | None:
        return None if self.launch_with == ONE_PROCESS else self.launch_with


@dataclass
class Checked:
    """What validating (or launching) the form tells the user."""

    report: str  # `finetune validate`'s output
    message: str
    field_error: str = ""
    ok: bool = False
    launched: str | None = None  # the run's name, once launched


def recipe_fields(workspace: Workspace, recipe: str) -> tuple[dict[str, str] | None, str]:
    """The recipe's values of the tab's fields (None where it cannot be read), and a message."""
    try:
        values = workspace.recipe_fields(recipe)
    except PanelError as error:
        return None, f"⚠ {error}"
    return {label: "" if values[label] is None else str(values[label]) for label in FIELDS}, ""


def preview(workspace: Workspace, form: Form) -> str:
    """The command Launch runs, one setting per line."""
    try:
        command = workspace.command(form.recipe, form.overrides(), form.run_name or workspace.free_run_name(),
                                    form.accelerate())
    except PanelError as error:
        return f"# {error}"
    return shell_lines(["finetune", *command[3:]])


def validate(workspace: Workspace, form: Form) -> Checked:
    try:
        ok, text = workspace.validate(form.recipe, form.overrides(), form.run_name or workspace.free_run_name())
    except PanelError as error:
        return Checked("", f"⚠ {error}")
    if ok:
        return Checked(text, "✓ The recipe and its data are valid.", ok=True)
    return Checked(text, f"⚠ {text.removeprefix('error: ')}", field_error(text))


def launch(workspace: Workspace, models: ChatModels, form: Form) -> Checked:
    name = form.run_name or workspace.free_run_name()  # typed names are never replaced under the user
    try:
        overrides = form.overrides()
        ok, text = workspace.validate(form.recipe, overrides, name)
        if not ok:
            return Checked(text, f"⚠ Not launched: {text.removeprefix('error: ')}", field_error(text))
        command = workspace.command(form.recipe, overrides, name, form.accelerate())
        unloaded = models.release_all()  # the run's processes get the GPU memory chat models held
        workspace.launch(command, name)
    except PanelError as error:
        return Checked("", f"⚠ {error}")
    note = unloaded_note(unloaded, " to free its memory")
    return Checked(text, f"✓ Launched **{name}**{note}: follow it in the Live tab.", ok=True, launched=name)


def plan_memory(workspace: Workspace, form: Form, gpu: str) -> str:
    try:
        return workspace.estimate(form.recipe, form.overrides(), form.accelerate(), None if gpu == THIS_CPU else gpu)
    except PanelError as error:
        return f"{error}"


def save_upload(workspace: Workspace, path: str | None) -> tuple[str | None, str]:
    """An uploaded recipe saved into the workspace: (its name or None, a message)."""
    if path is None:
        return None, ""
    try:
        with open(path, encoding="utf-8") as handle:
            name = workspace.save_recipe(path.rsplit("/", 1)[-1], handle.read())
    except (PanelError, UnicodeDecodeError) as error:
        return None, f"⚠ {error}"
    return name, f"Saved as `{name}`; validate it next."


def shell_lines(command: list[str]) -> str:
    """The command as a shell line per setting: `finetune train RECIPE`, then each override and option."""
    lines, rest = [shlex.join(command[:3])], command[3:]
    while rest:
        take = 2 if rest[0].startswith("--") and len(rest) > 1 else 1
        lines.append(shlex.join(rest[:take]))
        rest = rest[take:]
    return " \\\n    ".join(lines)


def field_error(message: str) -> str:
    """The field a validation message is about, when it names one of the tab's keys."""
    for label, key in FIELDS.items():
        if key in message:
            return f"⚠ **{label}** (`{key}`): {message.removeprefix('error: ')}"
    return ""


def launcher_choice(name: str) -> tuple[str, str]:
    """(label, value) of a launcher: an accelerate config by its name, `ray:N` as Ray Train with N workers."""
    workers = name.removeprefix(RAY_PREFIX)
    return (f"Ray Train, {workers} workers", name) if name.startswith(RAY_PREFIX) else (name, name)


def build(app: gr.Blocks, workspace: Workspace, models: ChatModels, live_run: gr.Dropdown) -> None:
    """Lay out the tab and bind its handlers; a launched run becomes the Live tab's `live_run`."""
    with gr.Row():
        recipe = gr.Dropdown(workspace.recipe_names(), label="Recipe", value="quickstart", scale=2)
        upload = gr.UploadButton("Upload a recipe (YAML)", file_types=[".yaml", ".yml"], scale=1)
        launcher = gr.Dropdown([ONE_PROCESS, *map(launcher_choice, workspace.launchers())], value=ONE_PROCESS,
                               label="Launch with", scale=1)
    with gr.Row():
        run_name = gr.Textbox(label="Run name", placeholder="empty: a fresh run-DATE-TIME")
        fields = {label: gr.Dropdown(STAGE_CHOICES, value="", label=label) if label == "stage"
                  else gr.Textbox(label=label) for label in FIELDS}
    extra = gr.Textbox(label="More settings (key=value, one per line)", lines=2,
                       placeholder="train.max_steps=200\ntrain.per_device_train_batch_size=4")
    with gr.Row():
        validate_button = gr.Button("Validate")
        launch_button = gr.Button("Launch", variant="primary")
    message = gr.Markdown()
    field_errors = gr.Markdown(elem_classes="field-error")
    command_view = gr.Code(label="Command", language="shell", interactive=False, lines=3, max_lines=12)
    with gr.Row():
        gpu = gr.Dropdown(GPU_CHOICES, value=THIS_CPU, label="Plan for", scale=1)
        plan_button = gr.Button("Plan memory, time and cost", scale=1)
    memory = gr.Code(label="Memory per device, then time and cost (finetune estimate)", language=None,
                     interactive=False, lines=6, max_lines=20)
    with gr.Accordion("Validation report", open=False) as report:
        validation = gr.Code(label="Validation", language="yaml", interactive=False, lines=8, max_lines=30)

    def form(recipe_name, launch_with, name, *values) -> Form:
        *field_values, extra_text = values
        return Form(recipe_name, launch_with, name.strip(), dict(zip(FIELDS, field_values)), extra_text)

    def on_recipe(name):
        values, text = recipe_fields(workspace, name)
        if values is None:
            return [gr.update()] * len(FIELDS) + [text]
        return [gr.update(value=values[label]) for label in FIELDS] + [text]

    def on_validate(*values):
        checked = validate(workspace, form(*values))
        return (checked.report, checked.message, checked.field_error,
                gr.update(open=checked.ok) if checked.report else gr.update())

    def on_launch(*values):
        checked = launch(workspace, models, form(*values))
        if not checked.launched:
            return checked.report, checked.message, checked.field_error, gr.update(), gr.update()
        return (checked.report, checked.message, "", gr.update(choices=workspace.run_names(), value=checked.launched),
                "")  # the next Launch takes a fresh name

    def on_upload(path):
        name, text = save_upload(workspace, path)
        return (gr.update(choices=workspace.recipe_names(), value=name) if name else gr.update()), text

    form_inputs = [recipe, launcher, run_name, *fields.values(), extra]
    recipe.change(on_recipe, recipe, [*fields.values(), message])
    upload.upload(on_upload, upload, [recipe, message])
    for component in form_inputs:
        component.change(lambda *values: preview(workspace, form(*values)), form_inputs, command_view,
                         show_progress="hidden")
    validate_button.click(on_validate, form_inputs, [validation, message, field_errors, report], api_name="validate")
    launch_button.click(on_launch, form_inputs, [validation, message, field_errors, live_run, run_name],
                        api_name="launch")
    plan_inputs = [gpu, *form_inputs]
    plan_button.click(lambda choice, *values: plan_memory(workspace, form(*values), choice), plan_inputs, memory,
                      api_name="plan")
    gpu.change(lambda choice, *values: plan_memory(workspace, form(*values), choice), plan_inputs, memory)
    app.load(on_recipe, recipe, [*fields.values(), message])
    app.load(lambda *values: preview(workspace, form(*values)), form_inputs, command_view)
