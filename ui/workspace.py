"""The panel's workspace and its runs, without torch or gradio: what the panel reads, writes and starts.

    WORKSPACE/recipes/     recipes uploaded through the panel (shipped ones come from configs/)
    WORKSPACE/runs/NAME/   run folders, written by the runs themselves (finetune/run_folder.py says what is in them)
    WORKSPACE/exports/     exports
    WORKSPACE/data/        data files to evaluate on (the Evaluate tab lists them, and builtin:unseen-names)
    WORKSPACE/.evals/      each evaluation the panel ran: `finetune eval --out`
    WORKSPACE/mlflow.db    MLflow's store, for runs that report to MLflow (artifacts in WORKSPACE/mlartifacts/)
    WORKSPACE/.launches/   one record (NAME.json: command, process group, when its leader started) and console log
                           per launch

Every path the panel accepts is a name resolved inside these folders; runs are started as argument lists, each in
its own process group, so closing the panel does not stop them and a stop reaches every DDP rank. A restarted panel
finds its runs again from their folders and launch records, and a run started from the command line in the
workspace shows too. A process is signalled only once it is known to be the run's: the run's own lock says who
runs it, and a launch record's process group counts only while its leader is the process that was started.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from finetune import run_folder
from finetune.resources import accelerate_configs_dir, recipes_dir
from finetune.training.launcher import group_alive, process_tree, send, send_group, start_time
from finetune.ui.run_info import RunInfo

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
FIELDS = {  # the recipe keys the Train tab edits, by label
    "base model": "model.name_or_path",
    "dataset": "data.train",
    "learning rate": "train.learning_rate",
    "epochs": "train.num_train_epochs",
    "LoRA rank": "lora.r",
    "max length": "train.max_length",
    "stage": "stage",
    "continue the adapter of (a run folder)": "model.adapter",
}


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
RAY_PREFIX = "ray:"
RAY_WORKERS = (2, 4, 8)
EVAL_TIMEOUT_S = 6 * 3600  # lm-eval tasks on a large model take hours
EXPORT_TIMEOUT_S = 3 * 3600  # a merged 20B model is loaded twice (merged, then checked) and may be pushed


class PanelError(Exception):
    """A request the panel refuses, with the reason to show."""


class Workspace:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.recipes = self.root / "recipes"
        self.runs = self.root / "runs"
        self.exports = self.root / "exports"
        self.launches = self.root / ".launches"
        self.data = self.root / "data"
        self.evals = self.root / ".evals"

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

    @classmethod
    def launchers(cls) -> list[str]:
        """What a run can be launched with besides one process: the accelerate configs, and Ray Train with a
        number of workers (`ray:N`, on the cluster RAY_ADDRESS names, else a local one) where Ray is installed."""
        ray = [f"{RAY_PREFIX}{workers}" for workers in RAY_WORKERS] if importlib.util.find_spec("ray") else []
        return [*cls.accelerate_config_names(), *ray]

    def _launch_options(self, launch_with: str | None) -> list[str]:
        if not launch_with:
            return []
        if launch_with not in self.launchers():
            raise PanelError(f"cannot launch with {launch_with!r}: choose one of {', '.join(self.launchers())}")
        if launch_with.startswith(RAY_PREFIX):
            return ["--engine", "ray", "--num-workers", launch_with.removeprefix(RAY_PREFIX)]
        return ["--accelerate-config", launch_with]

    # Runs.
    def run_folder(self, name: str) -> Path:
        return self.runs / check_name(name, "run name")

    def command(self, recipe: str, overrides: list[str], run_name: str, launch_with: str | None) -> list[str]:
        """`finetune train` for the run; `launch_with` is one of `launchers()`, or None for one process."""
        return [sys.executable, "-m", "finetune", "train", str(self.recipe_path(recipe)), *overrides,
                f"output_dir={self.run_folder(run_name)}", *self._launch_options(launch_with)]

    def validate(self, recipe: str, overrides: list[str], run_name: str) -> tuple[bool, str]:
        """`finetune validate`, the CLI's own checks, in a child process: (ok, what it printed)."""
        command = [sys.executable, "-m", "finetune", "validate", str(self.recipe_path(recipe)), *overrides,
                   f"output_dir={self.run_folder(run_name)}"]
        result = subprocess.run(command, capture_output=True, text=True, cwd=self.root, timeout=900)
        return result.returncode == 0, (result.stdout if result.returncode == 0 else result.stderr).strip()

    def estimate(self, recipe: str, overrides: list[str], launch_with: str | None, gpu: str | None) -> str:
        """`finetune estimate` in a child process: the memory plan, then the time and cost plan, or its error."""
        command = [sys.executable, "-m", "finetune", "estimate", str(self.recipe_path(recipe)), *overrides,
                   *(["--gpu", gpu] if gpu else ["--device", "cpu"])]
        launch = self._launch_options(launch_with)
        if launch[:2] == ["--engine", "ray"]:
            command += ["--num-gpus", launch[-1]]  # a Ray worker is a DDP process
        else:
            command += launch
        result = subprocess.run(command, capture_output=True, text=True, cwd=self.root, timeout=300)
        return (result.stdout if result.returncode == 0 else result.stderr).strip()

    def launch(self, command: list[str], run_name: str, resuming: bool = False) -> int:
        """Start a run in its own process group; returns its process id (= its group id)."""
        self.create()
        record = self.launches / f"{check_name(run_name, 'run name')}.json"
        if not resuming and (record.exists() or self.run_folder(run_name).exists()):
            raise PanelError(f"a run named {run_name!r} exists already; choose another name")
        with open(self.launches / f"{run_name}.log", "a" if resuming else "w", encoding="utf-8") as console:
            process = subprocess.Popen(command, cwd=self.root, stdout=console, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        record.write_text(json.dumps({"pid": process.pid, "leader_started": start_time(process.pid),
                                      "command": command, "started": time.time()}), encoding="utf-8")
        return process.pid

    def free_run_name(self) -> str:
        """A default name for the next run, not taken yet."""
        stem = f"run-{time.strftime('%Y%m%d-%H%M%S')}"
        name, number = stem, 1
        while (self.launches / f"{name}.json").exists() or self.run_folder(name).exists():
            number += 1
            name = f"{stem}-{number}"
        return name

    def resume(self, name: str) -> int:
        """Continue a stopped or failed run from its newest complete checkpoint, launched as it was before."""
        info = self.run(name)
        if not info.resumable:
            why = "it has no complete checkpoint" if info.status in ("stopped", "failed") else f"it is {info.status}"
            raise PanelError(f"run {name!r} cannot be resumed: {why}")
        folder = self.run_folder(name)
        before = (self._launch_record(name) or {}).get("command", [])
        first_option = next((index for index, item in enumerate(before) if item.startswith("--")), len(before))
        launch = [item for item in before[first_option:] if item != "--resume"]  # as it was launched
        command = [sys.executable, "-m", "finetune", "train", str(folder / run_folder.CONFIG_NAME),
                   f"output_dir={folder}", "--resume", *launch]
        return self.launch(command, name, resuming=True)

    def runs_list(self) -> list[RunInfo]:
        names = {path.name for path in self.runs.glob("*") if path.is_dir() and NAME.match(path.name)}
        names |= {path.stem for path in self.launches.glob("*.json") if NAME.match(path.stem)}
        infos = [self.run(name) for name in names]
        return sorted(infos, key=lambda info: info.started or 0, reverse=True)

    def run_names(self) -> list[str]:
        return [info.name for info in self.runs_list()]

    def run(self, name: str) -> RunInfo:
        folder = self.run_folder(name)
        rows = run_folder.read_rows(folder)
        launch = self._launch_record(name)
        started = launch["started"] if launch else (folder.stat().st_mtime if folder.exists() else None)
        ended = run_folder.final_status(rows)
        if run_folder.running(folder) is not None:
            status = "running"  # started here or from the command line: its main process holds the run's lock
        elif launch and self._launched_group(launch) is not None:
            progress = folder / run_folder.PROGRESS_NAME
            earlier = ended and progress.stat().st_mtime < launch["started"]  # the status of a run now resumed
            status = "starting" if not ended or earlier else ended["status"]
        elif ended:
            status = ended["status"]
        else:
            status = "failed"  # ended without its status line: killed, or failed before training began
        resumable = status in ("stopped", "failed") and run_folder.latest_checkpoint(folder) is not None
        return RunInfo(name, status, rows, started, resumable)

    def stop(self, name: str, grace_s: float = 120) -> str:
        """Stop gracefully (SIGTERM: a checkpoint at the end of the step, status stopped), then by force; returns
        how it ended. Afterwards no process of the run is left."""
        launch = self._launch_record(name) or {}
        group = self._launched_group(launch)
        holder = run_folder.running(self.run_folder(name))
        if group is None and holder is None:
            return "not running"
        # A run the panel launched gets the signal as its whole process group; one started from the command line,
        # at its main process (which tells the others). A Ray launch, at its driver alone: Ray's own processes
        # share its group and would end at once.
        if group is not None and _with_ray(launch.get("command", [])):
            send(group, signal.SIGTERM)  # the group's leader
        elif group is not None:
            send_group(group, signal.SIGTERM)
        else:
            send(holder["pid"], signal.SIGTERM)
        alive = (lambda: group_alive(group)) if group is not None else \
            (lambda: run_folder.running(self.run_folder(name)) is not None)
        deadline = time.monotonic() + grace_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        if not alive():
            return "stopped"
        leader = group if group is not None else holder["pid"]
        for pid in [*process_tree(leader), leader]:  # training processes may sit in sessions of their own
            send(pid, signal.SIGKILL)
        if group is not None:
            send_group(group, signal.SIGKILL)
        while alive():
            time.sleep(0.2)
        return "killed"

    def _launched_group(self, launch: dict) -> int | None:
        """The launch record's process group while it still is the run's: its leader is the very process the panel
        started (same start time), or has ended while others of its group go on (a group id is not given out again
        while the group has members). A process id the system has since given to another program is not the run's."""
        group = launch.get("pid")
        if group is None or not group_alive(group):
            return None
        leader_started = start_time(group)
        if leader_started is not None and leader_started != launch.get("leader_started"):
            return None
        return group

    def console_tail(self, name: str, lines: int = 40) -> str:
        """The last lines of the run's log, or of its console when that is newer (a launch that failed before
        training, e.g. a refused resume); progress bars reduced to their last state."""
        logs = [path for path in (self.run_folder(name) / run_folder.LOG_NAME,
                                  self.launches / f"{check_name(name, 'run name')}.log")
                if path.is_file() and path.stat().st_size]
        if not logs:
            return ""
        text = max(logs, key=lambda path: path.stat().st_mtime).read_text(encoding="utf-8", errors="replace")
        return "\n".join([line.rsplit("\r", 1)[-1] for line in text.splitlines()][-lines:])

    def checkpoints(self, name: str) -> list[str]:
        folder = self.run_folder(name)
        complete = [path.name for path in run_folder.checkpoints(folder)]
        return (["final"] if (folder / run_folder.FINAL_NAME).is_dir() else []) + complete[::-1]

    def model_folder(self, run: str, checkpoint: str) -> Path:
        if checkpoint not in self.checkpoints(run):
            raise PanelError(f"run {run!r} has no complete {checkpoint!r}")
        return self.run_folder(run) / checkpoint

    # Evaluation: targets and data by name, `finetune eval` in its own process.
    def eval_targets(self) -> list[str]:
        """RUN (its final model), RUN/checkpoint-N and base:RUN for each run with a model."""
        targets = []
        for info in self.runs_list():
            found = self.checkpoints(info.name)
            targets += [info.name if checkpoint == "final" else f"{info.name}/{checkpoint}" for checkpoint in found]
            targets += [f"base:{info.name}"] if found else []
        return targets

    def data_names(self) -> list[str]:
        files = sorted(path.name for path in self.data.glob("*") if path.suffix in DATA_SUFFIXES)
        return [*files, "builtin:unseen-names"]

    def evaluate(self, targets: list[str], data: str, metrics: list[str], max_new_tokens: int,
                 limit: int | None) -> tuple[list[dict], list[dict], str]:
        """`finetune eval` on the targets: (the table's rows, one per metric with a column per target; the answers
        side by side, one row per example; its output)."""
        if not targets:
            raise PanelError("pick at least one run, checkpoint or base model")
        if data not in self.data_names():
            raise PanelError(f"data {data!r}: pick one of {', '.join(self.data_names())}")
        folders = [self._eval_folder(target) for target in targets]
        out = self.evals / time.strftime("%Y%m%d-%H%M%S")
        command = [sys.executable, "-m", "finetune", "eval", *folders,
                   "--data", data if data.startswith("builtin:") else str(self.data / data),
                   "--max-new-tokens", str(int(max_new_tokens)), "--out", str(out),
                   *[option for metric in metrics for option in ("--metric", metric)],
                   *(["--limit", str(int(limit))] if limit else [])]
        result = subprocess.run(command, capture_output=True, text=True, cwd=self.root, timeout=EVAL_TIMEOUT_S)
        output = (result.stdout + result.stderr).strip()
        if result.returncode != 0:
            raise PanelError(output.splitlines()[-1] if output else f"finetune eval: exit status {result.returncode}")
        records = {json.loads(path.read_text(encoding="utf-8"))["target"]: path
                   for path in out.glob("*.json")}
        table, answers = [], []
        for target, folder in zip(targets, folders):
            record = json.loads(records[folder].read_text(encoding="utf-8"))
            for metric, value in record["metrics"].items():
                row = next((r for r in table if r["metric"] == metric), None)
                if row is None:
                    table.append(row := {"metric": metric})
                row[target] = value
            lines = records[folder].with_name(records[folder].stem + ".answers.jsonl").read_text(encoding="utf-8")
            for index, line in enumerate(lines.splitlines()):
                answer = json.loads(line)
                if index == len(answers):
                    answers.append({"prompt": answer["prompt"], "reference": answer["reference"]})
                answers[index][target] = answer["answer"] + ("" if answer["stopped"] else " …")
        return table, answers, output

    def export(self, run: str, checkpoint: str, name: str, merge: bool, dtype: str, repo: str,
               private: bool) -> str:
        """`finetune export` of a run's model into exports/NAME (merged in `dtype`, pushed to `repo` if given):
        what it printed."""
        folder = self.model_folder(run, checkpoint)
        out = self.exports / check_name((name or "").strip(), "export name")
        command = [sys.executable, "-m", "finetune", "export", str(folder), "--out", str(out),
                   *(["--merge", "--dtype", dtype] if merge else []),
                   *(["--push-to-hub", repo.strip(), *(["--private"] if private else [])] if repo.strip() else [])]
        result = subprocess.run(command, capture_output=True, text=True, cwd=self.root, timeout=EXPORT_TIMEOUT_S)
        return (result.stdout + result.stderr).strip() or f"exit status {result.returncode}"

    def _eval_folder(self, target: str) -> str:
        """The `finetune eval` target of a panel target: its model folder, or base: and any model of the run."""
        base = target.startswith("base:")
        run, _, checkpoint = target.removeprefix("base:").partition("/")
        found = self.checkpoints(run)
        if not found:
            raise PanelError(f"run {run!r} has no model yet")
        folder = self.model_folder(run, found[0] if base else checkpoint or "final")
        return ("base:" if base else "") + str(folder)

    def _launch_record(self, name: str) -> dict | None:
        path = self.launches / f"{check_name(name, 'run name')}.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise PanelError(f"{what} {name!r}: use letters, digits, '.', '_' and '-' (no paths)")
    return name


def _with_ray(command: list[str]) -> bool:
    return any(option == "--engine" and value == "ray" for option, value in zip(command, command[1:]))
