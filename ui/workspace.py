"""The panel's workspace and its runs, without torch or gradio: what the panel reads, writes and starts.

    WORKSPACE/recipes/     recipes uploaded through the panel (shipped ones come from configs/)
    WORKSPACE/runs/NAME/   run folders, written by the runs themselves (see finetune/run_folder.py)
    WORKSPACE/exports/     exports
    WORKSPACE/.launches/   one record (NAME.json: command, process group, start time) and console log per launch

Every path the panel accepts is a name resolved inside these folders; runs are started as argument lists, each in
its own process group, so closing the panel does not stop them and a stop reaches every DDP rank. A restarted panel
finds its runs again from their folders and launch records.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune.resources import accelerate_configs_dir, recipes_dir

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
FIELDS = {  # the recipe keys the Train tab edits, by label
    "base model": "model.name_or_path",
    "dataset": "data.train",
    "learning rate": "train.learning_rate",
    "epochs": "train.num_train_epochs",
    "LoRA rank": "lora.r",
    "max length": "train.max_length",
}


class PanelError(Exception):
    """A request the panel refuses, with the reason to show."""


@dataclass
class RunInfo:
    name: str
    status: str  # starting | running | completed | stopped | failed
    rows: list[dict]
    started: float | None

    @property
    def train_rows(self) -> list[dict]:
        return [row for row in self.rows if "loss" in row]

    @property
    def last(self) -> dict:
        return self.train_rows[-1] if self.train_rows else {}

    @property
    def duration_s(self) -> float | None:
        return self.rows[-1]["elapsed_s"] if self.rows and "elapsed_s" in self.rows[-1] else None

    @property
    def eta_s(self) -> float | None:
        last = self.last
        if self.status != "running" or not last.get("total_steps") or not last.get("step"):
            return None
        return last["elapsed_s"] / last["step"] * (last["total_steps"] - last["step"])


class Workspace:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.recipes = self.root / "recipes"
        self.runs = self.root / "runs"
        self.exports = self.root / "exports"
        self.launches = self.root / ".launches"

    def create(self) -> None:
        for folder in (self.recipes, self.runs, self.exports, self.launches):
            folder.mkdir(parents=True, exist_ok=True)

    # Recipes and launch configs: chosen by name, never by path.
    def recipe_names(self) -> list[str]:
        shipped = sorted(path.stem for path in recipes_dir().glob("*.yaml"))
        uploaded = sorted(f"recipes/{path.stem}" for path in self.recipes.glob("*.yaml"))
        return shipped + uploaded

    def recipe_path(self, name: str) -> Path:
        if name.startswith("recipes/"):
            path = self.recipes / f"{check_name(name.removeprefix('recipes/'), 'recipe')}.yaml"
        else:
            path = recipes_dir() / f"{check_name(name, 'recipe')}.yaml"
        if not path.is_file():
            raise PanelError(f"no recipe named {name!r}")
        return path

    def recipe_fields(self, name: str) -> dict[str, object]:
        """The Train tab's fields as the recipe sets them (its raw YAML; defaults are the recipe's business)."""
        raw = yaml.safe_load(self.recipe_path(name).read_text(encoding="utf-8")) or {}
        values = {}
        for label, key in FIELDS.items():
            node = raw
            for part in key.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            values[label] = node
        return values

    def save_recipe(self, filename: str, text: str) -> str:
        """Keep an uploaded recipe in the workspace; returns its name."""
        stem = check_name(Path(filename).stem, "recipe file")
        try:
            if not isinstance(yaml.safe_load(text), dict):
                raise PanelError(f"{filename}: a recipe is a YAML mapping (model:, data:, train:, ...)")
        except yaml.YAMLError as error:
            raise PanelError(f"{filename}: not valid YAML: {error}") from None
        self.recipes.mkdir(parents=True, exist_ok=True)
        (self.recipes / f"{stem}.yaml").write_text(text, encoding="utf-8")
        return f"recipes/{stem}"

    @staticmethod
    def accelerate_config_names() -> list[str]:
        return sorted(path.stem for path in accelerate_configs_dir().glob("*.yaml"))

    # Runs.
    def run_folder(self, name: str) -> Path:
        return self.runs / check_name(name, "run name")

    def command(self, recipe: str, overrides: list[str], run_name: str, accelerate_config: str | None) -> list[str]:
        command = [sys.executable, "-m", "finetune", "train", str(self.recipe_path(recipe)),
                   *overrides, f"output_dir={self.run_folder(run_name)}"]
        if accelerate_config:
            if accelerate_config not in self.accelerate_config_names():
                raise PanelError(f"no accelerate config named {accelerate_config!r}")
            command += ["--accelerate-config", accelerate_config]
        return command

    def validate(self, recipe: str, overrides: list[str], run_name: str) -> tuple[bool, str]:
        """`finetune validate`, the CLI's own checks, in a child process: (ok, what it printed)."""
        command = [sys.executable, "-m", "finetune", "validate", str(self.recipe_path(recipe)), *overrides,
                   f"output_dir={self.run_folder(run_name)}"]
        result = subprocess.run(command, capture_output=True, text=True, cwd=self.root, timeout=900)
        return result.returncode == 0, (result.stdout if result.returncode == 0 else result.stderr).strip()

    def launch(self, command: list[str], run_name: str) -> int:
        """Start a run in its own process group; returns its process id (= its group id)."""
        self.create()
        record = self.launches / f"{check_name(run_name, 'run name')}.json"
        if record.exists() or self.run_folder(run_name).exists():
            raise PanelError(f"a run named {run_name!r} exists already; choose another name")
        with open(self.launches / f"{run_name}.log", "w", encoding="utf-8") as console:
            process = subprocess.Popen(command, cwd=self.root, stdout=console, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        record.write_text(json.dumps({"pid": process.pid, "command": command, "started": time.time()}),
                          encoding="utf-8")
        return process.pid

    def runs_list(self) -> list[RunInfo]:
        names = {path.name for path in self.runs.glob("*") if path.is_dir()}
        names |= {path.stem for path in self.launches.glob("*.json")}
        infos = [self.run(name) for name in names]
        return sorted(infos, key=lambda info: info.started or 0, reverse=True)

    def run(self, name: str) -> RunInfo:
        folder = self.run_folder(name)
        rows = read_progress(folder / "progress.jsonl")
        launch = self._launch_record(name)
        started = launch["started"] if launch else (folder.stat().st_mtime if folder.exists() else None)
        if rows and "status" in rows[-1]:
            status = rows[-1]["status"]
        elif launch and group_alive(launch["pid"]):
            status = "running" if rows else "starting"
        else:
            status = "failed"  # ended without its status line: killed, or failed before training began
        return RunInfo(name, status, rows, started)

    def stop(self, name: str, grace_s: float = 120) -> str:
        """Stop gracefully (SIGTERM: a checkpoint at the end of the step, status stopped), then by force; returns
        how it ended. Afterwards no process of the run is left."""
        launch = self._launch_record(name)
        if not launch or not group_alive(launch["pid"]):
            return "not running"
        group = launch["pid"]
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.5)
        if not group_alive(group):
            return "stopped"
        _signal_group(group, signal.SIGKILL)
        while group_alive(group):
            time.sleep(0.2)
        return "killed"

    def console_tail(self, name: str, lines: int = 40) -> str:
        """The last lines the run printed (progress bars reduced to their last state)."""
        for path in (self.run_folder(name) / "train.log", self.launches / f"{check_name(name, 'run name')}.log"):
            if path.is_file() and path.stat().st_size:
                text = path.read_text(encoding="utf-8", errors="replace")
                cleaned = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
                return "\n".join(cleaned[-lines:])
        return ""

    def checkpoints(self, name: str) -> list[str]:
        folder = self.run_folder(name)
        found = sorted((path.name for path in folder.glob("checkpoint-*") if path.is_dir()),
                       key=lambda n: int(n.rsplit("-", 1)[-1]))
        return (["final"] if (folder / "final").is_dir() else []) + found[::-1]

    def model_folder(self, run: str, checkpoint: str) -> Path:
        if checkpoint != "final" and not re.fullmatch(r"checkpoint-\d+", checkpoint or ""):
            raise PanelError(f"no checkpoint named {checkpoint!r}")
        path = self.run_folder(run) / checkpoint
        if not path.is_dir():
            raise PanelError(f"run {run!r} has no {checkpoint}")
        return path

    def _launch_record(self, name: str) -> dict | None:
        path = self.launches / f"{check_name(name, 'run name')}.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise PanelError(f"{what} {name!r}: use letters, digits, '.', '_' and '-' (no paths)")
    return name


def read_progress(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return rows


def group_alive(group: int) -> bool:
    _reap(group)  # a run this panel started and that has ended would otherwise linger as a zombie, "alive"
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(pid: int) -> None:
    """Collect the exit status of a run this panel process started; nothing for others."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        pass
