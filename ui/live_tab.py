"""The Live tab: one run's status card, loss and learning-rate curves, stage metrics, sampled answers and log, with
Stop and Resume."""

from __future__ import annotations

import gradio as gr
import pandas as pd

from finetune import run_folder
from finetune.mlflow_store import recorded
from finetune.plan.time_plan import format_duration
from finetune.ui.chat_models import ChatModels, unloaded_note
from finetune.ui.run_info import RunInfo
from finetune.ui.workspace import PanelError, Workspace

NO_RUN = "No run selected."


def progress(workspace: Workspace, name: str | None) -> tuple:
    """(status card, loss/learning-rate frame, samples frame, log tail, stage-metrics frame) of a run."""
    if not name:
        return NO_RUN, None, None, "", None
    try:
        info = workspace.run(name)
    except PanelError as error:
        return f"⚠ {error}", None, None, "", None
    # float columns even while empty: a plot's first frame fixes its axes' types
    frame = pd.DataFrame(info.train_rows, columns=["step", "loss", "learning_rate"]).astype(float)
    return (status_card(info), frame, pd.DataFrame(info.samples) if info.samples else None,
            workspace.console_tail(name), stage_frame(info.train_rows))


def stop(workspace: Workspace, name: str | None) -> str:
    if not name:
        return NO_RUN
    try:
        how = workspace.stop(name)
    except PanelError as error:
        return f"⚠ {error}"
    return status_card(workspace.run(name)) + f"\n\nStop: {how}."


def resume(workspace: Workspace, models: ChatModels, name: str | None) -> str:
    if not name:
        return NO_RUN
    try:
        unloaded = models.release_all()
        workspace.resume(name)
    except PanelError as error:
        return f"⚠ {error}"
    resumed = f"Resumed from its newest complete checkpoint{unloaded_note(unloaded)}."
    return status_card(workspace.run(name)) + f"\n\n{resumed}"


def stage_frame(rows: list[dict]) -> pd.DataFrame | None:
    """DPO's and KTO's reward margins and accuracies, GRPO's rewards, one line per metric; None for SFT."""
    points = [{"step": float(row["step"]), "metric": key, "value": float(value)}
              for row in rows for key, value in row.items() if run_folder.plotted_stage_metric(key)]
    return pd.DataFrame(points) if points else None


def status_card(info: RunInfo) -> str:
    color = {"running": "#16a34a", "starting": "#ca8a04", "completed": "#2563eb", "stopped": "#6b7280",
             "failed": "#dc2626"}.get(info.status, "#6b7280")
    icon = f'<span style="color:{color}">●</span>'
    last = info.last
    parts = [f"### {icon} {info.name} · {info.status}"]
    if last:
        if info.eta_s is None:
            timing = f"elapsed {format_duration(info.duration_s)}"
        else:
            left = info.planned_left_s
            timing = f"ETA **{format_duration(info.eta_s)}**" + (f" (planned {format_duration(left)})" if left is not None else "")
        parts.append(" · ".join([
            f"step **{last['step']}**" + (f" / {last['total_steps']}" if last.get("total_steps") else ""),
            f"loss **{last['loss']:.4f}**",
            f"**{last.get('tokens_per_second', 0):,.0f}** tokens/s",
            timing,
            f"peak memory **{last.get('peak_memory_gb', 0):.2f} GB**",
        ]))
    if info.plan:
        plan = info.plan
        parts.append(f"Time plan at the start: **{format_duration(plan['total_s'])}** for {plan['steps']:,} steps "
                     f"on {plan['device']} · {plan['speed']}")
    if info.status == "failed" and info.rows and info.rows[-1].get("error"):
        parts.append(f"Error: `{info.rows[-1]['error']}`")
    mlflow = recorded(info.rows)
    if mlflow:
        parts.append(f"MLflow run `{mlflow['run_id']}` · open it with `{mlflow['open']}`")
    if info.resumable:
        parts.append("**Resume** continues it from its newest complete checkpoint.")
    return "\n\n".join(parts)


def build(workspace: Workspace, models: ChatModels, timer: gr.Timer, live_run: gr.Dropdown) -> None:
    """Lay out the tab around `live_run` (made by the app: a launch on the Train tab picks it) and bind it."""
    with gr.Row():
        live_run.render()
        stop_button = gr.Button("Stop", variant="stop", scale=1)
        resume_button = gr.Button("Resume", scale=1)
    status = gr.Markdown(elem_classes="status-card")
    with gr.Row():
        loss_plot = gr.LinePlot(x="step", y="loss", title="Loss", y_title="loss", y_axis_format=".3f", height=260)
        lr_plot = gr.LinePlot(x="step", y="learning_rate", title="Learning rate", y_title="learning rate",
                              y_axis_format=".1e", height=260)
    stage_plot = gr.LinePlot(x="step", y="value", color="metric", title="Rewards (DPO, KTO, GRPO)", y_title="value",
                             y_axis_format=".3f", height=260)
    samples = gr.Dataframe(label="Answers to held-out prompts at the last two evaluations (eval.samples; "
                           "… ran to the token limit)", interactive=False, wrap=True)
    log_tail = gr.Code(label="Log", language="shell", interactive=False, lines=12)

    def on_progress(name):
        card, frame, sampled, log, stages = progress(workspace, name)
        return card, frame, frame, sampled, log, stages  # one frame feeds both plots

    outputs = [status, loss_plot, lr_plot, samples, log_tail, stage_plot]
    live_run.change(on_progress, live_run, outputs, api_name="progress")
    timer.tick(on_progress, live_run, outputs, show_progress="hidden")
    stop_button.click(lambda name: stop(workspace, name), live_run, status, api_name="stop")
    resume_button.click(lambda name: resume(workspace, models, name), live_run, status, api_name="resume")
