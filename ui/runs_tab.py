"""The Runs tab: every run of the workspace in a table, and the loss curves of the ones picked, overlaid."""

from __future__ import annotations

import gradio as gr
import pandas as pd

from finetune import run_folder
from finetune.plan.time_plan import format_duration
from finetune.ui.run_info import RunInfo
from finetune.ui.workspace import Workspace

COLUMNS = ["run", "status", "steps", "duration", "final loss", "tokens/s"]


def overview(workspace: Workspace, selected: list[str] | None) -> tuple[pd.DataFrame, list[str], pd.DataFrame]:
    """(the runs table, every run's name, the loss curves of `selected` or, until the user picks, the latest three)."""
    infos = workspace.runs_list()
    selected = selected or [info.name for info in infos[:3]]
    table = pd.DataFrame([row(info) for info in infos], columns=COLUMNS)
    curves = pd.DataFrame([{"run": info.name, "step": point["step"], "loss": point["loss"]}
                           for info in infos if info.name in selected for point in info.train_rows],
                          columns=["run", "step", "loss"]).astype({"step": float, "loss": float})
    return table, [info.name for info in infos], curves


def row(info: RunInfo) -> dict:
    last, speed = info.last, run_folder.tokens_per_second(info.rows)
    return {"run": info.name, "status": info.status, "steps": run_folder.last_step(info.rows),
            "duration": format_duration(info.duration_s),
            "final loss": round(last["loss"], 4) if "loss" in last else None,
            "tokens/s": round(speed) if speed else None}


def build(app: gr.Blocks, workspace: Workspace, timer: gr.Timer) -> None:
    table = gr.Dataframe(interactive=False, wrap=True)
    compare = gr.Dropdown(label="Overlay the loss curves of", multiselect=True, choices=[], allow_custom_value=True)
    plot = gr.LinePlot(x="step", y="loss", color="run", title="Loss", height=300, y_axis_format=".3f")

    def on_overview(selected):
        runs, names, curves = overview(workspace, selected)
        return runs, gr.update(choices=names), curves

    outputs = [table, compare, plot]
    timer.tick(on_overview, compare, outputs, show_progress="hidden", api_name="runs")
    compare.change(on_overview, compare, outputs)
    app.load(on_overview, compare, outputs)
