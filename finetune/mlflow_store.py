"""Where a run's MLflow store is, and what a run folder recorded of its MLflow run, without importing MLflow: the
recipe's checks, the trainer's tracking, export's registration and the panel read it here."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from finetune.errors import UserError

DATABASE_NAME = "mlflow.db"
ARTIFACTS_NAME = "mlartifacts"


def workspace_of(run: str | Path) -> Path:
    """The folder that holds `runs/` (a panel's workspace, or where `finetune train` ran); a run folder outside
    a `runs/` folder counts its own parent folder as the workspace."""
    run = Path(run).absolute()
    return run.parent.parent if run.parent.name == "runs" else run.parent


def tracking_uri(run: str | Path, configured: str | None = None) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or \
        f"sqlite:///{workspace_of(run) / DATABASE_NAME}"


def open_command(uri: str) -> str:
    """How to look at the store: `mlflow ui` for a database or folder, the address for a server."""
    return uri if uri.startswith(("http://", "https://")) else f"mlflow ui --backend-store-uri {uri}"


def reports_to_mlflow(report_to: str | list[str] | None) -> bool:
    """Whether train.report_to (a name, a list of names or none) includes MLflow."""
    return "mlflow" in ([report_to] if isinstance(report_to, str) else list(report_to or []))


def check_store(run: str | Path, configured: str | None, where: str) -> None:
    """The embedded SQLite store needs SQLAlchemy and Alembic (the mlflow extra): said before anything loads."""
    uri = tracking_uri(run, configured)
    missing = [name for name in ("mlflow", "sqlalchemy", "alembic") if importlib.util.find_spec(name) is None]
    if uri.startswith("sqlite:") and missing:
        raise UserError(f"{where}: train.report_to mlflow logs to {uri}, which needs {', '.join(missing)}: "
                        "pip install -e \".[mlflow]\" (or set MLFLOW_TRACKING_URI to a tracking server)")


def recorded(rows: list[dict]) -> dict[str, Any] | None:
    """The MLflow run a run folder logs to ({run_id, experiment_id, tracking_uri, open}), if any: the latest, should
    a resumed run have moved to another store."""
    return next((row["mlflow"] for row in reversed(rows) if "mlflow" in row), None)
