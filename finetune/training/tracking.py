"""MLflow tracking (`train.report_to` includes mlflow): the run as an MLflow run, written by the main process.

- Where: MLFLOW_TRACKING_URI, else the recipe's mlflow.tracking_uri, else an embedded SQLite store in the
  workspace, `mlflow.db` beside `runs/` (no server needed), with its artifacts in `mlartifacts/` beside it.
- The experiment is mlflow.experiment (the recipe's name unless set); the MLflow run is named after the run folder.
- Params: the resolved recipe, flattened (model.name_or_path, train.learning_rate, ...). Metrics: every row that
  progress.jsonl gets (loss, learning rate, gradient norm, tokens/s, tokens, peak memory, eval loss and accuracy)
  at its step. Artifacts at the end: finetune.yaml, progress.jsonl and, with mlflow.log_model, the final model
  with its model card. The run's status follows the run's: FINISHED, KILLED (stopped) or FAILED.
- progress.jsonl keeps the MLflow run's id (an {"mlflow": ...} row), so a resumed run continues the same MLflow
  run, and the panel and `finetune export --register` find it. MLflow cannot delete metric values: the steps an
  interrupted run logged after its last checkpoint stay in the history beside the resumed run's.

Nothing else in the trainer knows MLflow exists; only this module imports it (mlflow_store.py says where the store
is, without importing MLflow).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from finetune.mlflow_store import ARTIFACTS_NAME, open_command, recorded, tracking_uri
from finetune.run_folder import CONFIG_NAME, FINAL_NAME, PROGRESS_NAME, RunFolder, read_rows
from finetune.training.resuming import flat_recipe

STATUS = {"completed": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
NOT_METRICS = ("step", "total_steps")


class MlflowTracking:
    """Made on the main process when the run reports to MLflow; `start`, `log_row` for each progress row,
    `finish` with the run's status."""

    def __init__(self, recipe, run_folder: RunFolder):
        from mlflow import MlflowClient

        self.recipe, self.run_folder = recipe, run_folder
        self.uri = tracking_uri(run_folder.path, recipe.mlflow.tracking_uri)
        self.client = MlflowClient(self.uri)
        self.run_id: str | None = None

    def start(self) -> None:
        """A new MLflow run, or the one this run folder logged to before (a resumed run)."""
        from mlflow.exceptions import MlflowException

        before = recorded(read_rows(self.run_folder.path))
        if before and before["tracking_uri"] == self.uri:
            try:
                self.client.update_run(before["run_id"], status="RUNNING")
                self.run_id = before["run_id"]
            except MlflowException:
                pass  # deleted from the store since: a new MLflow run
        if self.run_id is None:
            experiment = self._experiment_id()
            self.run_id = self.client.create_run(experiment, run_name=self.run_folder.path.name, tags={
                "finetune.run_folder": str(self.run_folder.path.absolute()), "finetune.method": self.recipe.method,
            }).info.run_id
            self.run_folder.append({"mlflow": {"run_id": self.run_id, "experiment_id": experiment,
                                               "tracking_uri": self.uri, "open": open_command(self.uri)}})
        self._log_params()
        print(f"mlflow: run {self.run_id} in {self.uri}", flush=True)

    def log_row(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, row["step"]) for key, value in row.items()
                   if key not in NOT_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool)]
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)
        if "samples" in row:  # eval.samples: the answers at this evaluation, as an artifact
            self.client.log_text(self.run_id, json.dumps(row["samples"], indent=1, ensure_ascii=False),
                                 f"samples/step-{row['step']:06d}.json")

    def finish(self, status: str) -> None:
        """Log the run's files, end the MLflow run with the run's status, and say where to look."""
        self.client.log_artifact(self.run_id, str(self.run_folder.path / CONFIG_NAME))
        self.client.log_artifact(self.run_id, str(self.run_folder.path / PROGRESS_NAME))
        final = self.run_folder.path / FINAL_NAME
        if self.recipe.mlflow.log_model and final.is_dir():
            self._log_model(final)
        self.client.set_terminated(self.run_id, STATUS[status])
        print(f"mlflow: run {self.run_id}; open it with: {open_command(self.uri)}", flush=True)

    def _experiment_id(self) -> str:
        name = self.recipe.mlflow.experiment
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        artifacts = None
        if self.uri.startswith("sqlite:///"):  # else MLflow's default is ./mlruns, wherever training started
            artifacts = (Path(self.uri.removeprefix("sqlite:///")).parent / ARTIFACTS_NAME / name).as_uri()
        return self.client.create_experiment(name, artifact_location=artifacts)

    def _log_params(self) -> None:
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        params = [Param(key, _shown(value)) for key, value in flat_recipe(self.recipe.to_dict()).items()
                  if key not in logged]  # a resumed run may only change what it logged already in how it logs
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100], synchronous=True)

    def _log_model(self, final: Path) -> None:
        from finetune.trained_model import model_card, saved_model

        with tempfile.TemporaryDirectory() as folder:
            model = Path(folder) / "model"
            shutil.copytree(final, model)
            model_card.write_card(saved_model.locate(final), model, self.run_folder.path.name, merged=False)
            self.client.log_artifacts(self.run_id, str(model), "model")


def register(export: Path, name: str, run: Path | None) -> tuple[str, str]:
    """Register a checked export as a new version of the registered model `name`, with its model card as the
    description, in the store the run was tracked in (else MLFLOW_TRACKING_URI, else the workspace's mlflow.db).
    Returns (version, tracking URI)."""
    from huggingface_hub import ModelCard
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    logged = recorded(read_rows(run)) if run else None
    uri = os.environ.get("MLFLOW_TRACKING_URI") or (logged["tracking_uri"] if logged else None) or \
        tracking_uri(run or export)
    client = MlflowClient(uri, registry_uri=uri)
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name)
    card = export / "README.md"
    same_store = logged is not None and logged["tracking_uri"] == uri
    version = client.create_model_version(
        name, source=str(export.absolute()), run_id=logged["run_id"] if same_store else None,
        description=ModelCard.load(card).text.strip() if card.is_file() else None,  # without its metadata
        tags={"finetune.run_folder": str(run.absolute())} if run else None)
    return version.version, uri


def _shown(value: Any) -> str:
    return str(value)[:6000]  # MLflow's limit for a param's value
