"""The web panel: built without side effects, refused where it would be exposed, driven end to end through
gradio_client and through a real headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

gradio_client = pytest.importorskip("gradio_client", reason="the panel's extra is not installed: pip install -e '.[ui]'")
pytestmark = pytest.mark.integration
# model, data, lr, epochs, r, length, stage, adapter
FIELDS = ["builtin:tiny-llama", "builtin:greetings", "0.001", "8", "", "256", "", ""]
LONG_RUN = "train.max_steps=2000\ntrain.eval_on_start=false\ntrain.logging_steps=2\ntrain.save_strategy=no"
ARTIFACTS = Path(os.environ.get("FINETUNE_TEST_ARTIFACTS", REPO / "test-artifacts"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Panel:
    """`finetune ui` in its own process, as a user starts it."""

    def __init__(self, workspace: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "finetune", "ui", "--workspace", str(workspace), "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, self.process.stdout.read()
            try:
                urllib.request.urlopen(self.url, timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the panel did not start"
                time.sleep(0.5)
        started = self.process.stdout.readline()  # its own line only: not Gradio's advice to `set share=True`
        assert started.startswith(f"finetune panel on {self.url}, workspace "), started
        self.client = gradio_client.Client(self.url, verbose=False)

    def close(self, sig: int = signal.SIGTERM) -> None:
        os.killpg(self.process.pid, sig)
        self.process.wait(timeout=30)


def wait_for(condition, timeout: float = 300, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)
    return result


def chat_workers(panel: Panel) -> list[int]:
    """The panel's chat model processes."""
    from finetune.training.launcher import process_tree

    return [pid for pid in process_tree(panel.process.pid)
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def group_gone(pid: int) -> bool:
    from finetune.training.launcher import group_alive

    return not group_alive(pid)


def test_importing_and_building_the_app_has_no_side_effects(tmp_path):
    script = (
        "import sys\n"
        "import finetune.ui\n"
        "assert 'gradio' not in sys.modules and 'torch' not in sys.modules\n"
        "from finetune.ui.app import build_app\n"
        "from finetune.ui.workspace import Workspace\n"
        f"build_app(Workspace({str(tmp_path / 'ws')!r}))\n"
        "heavy = [name for name in ('torch', 'transformers', 'trl', 'peft', 'unsloth') if name in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize("args, refused", [(["--host", "0.0.0.0"], "--host 0.0.0.0"), (["--share"], "--share")])
def test_exposed_panel_needs_auth(tmp_path, args, refused):
    result = run_cli("ui", "--workspace", str(tmp_path), *args)
    assert result.returncode == 2 and f"{refused} makes the panel reachable" in result.stderr
    assert "--auth USER:PASSWORD" in result.stderr and not any(tmp_path.iterdir())


def test_workspace_accepts_names_not_paths(tmp_path):
    from finetune.ui.workspace import PanelError, Workspace

    workspace = Workspace(tmp_path)
    for call in (lambda: workspace.run_folder("../outside"), lambda: workspace.recipe_path("../../etc/passwd"),
                 lambda: workspace.recipe_path("recipes/../x"), lambda: workspace.model_folder("r", "../../x"),
                 lambda: workspace.save_recipe("/etc/evil name.yaml", "model: {}")):
        with pytest.raises(PanelError):
            call()
    for stray in ("checkpoint-foo", "checkpoint-2", "checkpoint-7"):  # only checkpoint-7 is complete
        (tmp_path / "runs" / "r" / stray).mkdir(parents=True)
    (tmp_path / "runs" / "r" / "checkpoint-7" / "finetune_state.json").write_text("{}")
    assert workspace.checkpoints("r") == ["checkpoint-7"]
    with pytest.raises(PanelError):
        workspace.model_folder("r", "checkpoint-2")
    assert workspace.save_recipe("mine.yaml", "model: {name_or_path: builtin:tiny-llama}") == "recipes/mine"
    assert "recipes/mine" in workspace.recipe_names() and "quickstart" in workspace.recipe_names()
    command = workspace.command("recipes/mine", ["lora.r=4"], "r1", "cpu_ddp_2proc")
    assert command[1:4] == ["-m", "finetune", "train"] and command[-2:] == ["--accelerate-config", "cpu_ddp_2proc"]
    with pytest.raises(PanelError):
        workspace.command("recipes/mine", [], "r1", "../cpu_ddp_2proc")


def test_panel_launches_and_resumes_with_ray_and_shows_the_mlflow_run(tmp_path):
    """Ray Train where the extra is installed: the launch command, and a resume launched the same way."""
    pytest.importorskip("ray")
    from finetune.ui.live_tab import status_card
    from finetune.ui.workspace import Workspace

    workspace = Workspace(tmp_path)
    assert "ray:2" in workspace.launchers()
    command = workspace.command("quickstart", [], "r1", "ray:2")
    assert command[-4:] == ["--engine", "ray", "--num-workers", "2"]
    workspace.create()
    (workspace.launches / "r1.json").write_text(json.dumps({"pid": 0, "command": command, "started": 0.0}))
    folder = workspace.run_folder("r1")
    (folder / "checkpoint-2").mkdir(parents=True)
    (folder / "checkpoint-2" / "finetune_state.json").write_text("{}")
    mlflow = {"run_id": "abc123", "experiment_id": "1", "tracking_uri": "sqlite:///x/mlflow.db",
              "open": "mlflow ui --backend-store-uri sqlite:///x/mlflow.db"}
    (folder / "progress.jsonl").write_text(json.dumps({"mlflow": mlflow}) + "\n" + json.dumps(
        {"status": "failed", "step": 3, "elapsed_s": 1.0, "error": "a worker died"}) + "\n")
    resumed = []
    workspace.launch = lambda command, name, resuming=False: resumed.append(command)  # not started: its command
    workspace.resume("r1")
    assert resumed[0][-5:] == ["--resume", "--engine", "ray", "--num-workers", "2"]
    card = status_card(workspace.run("r1"))
    assert "MLflow run `abc123` · open it with `mlflow ui --backend-store-uri sqlite:///x/mlflow.db`" in card


def test_train_tab_validates_previews_and_plans_without_launching(tmp_path):
    """The Train tab's handlers, called as the page calls them: each check runs the CLI's, nothing starts."""
    from finetune.ui import train_tab
    from finetune.ui.workspace import FIELDS as LABELS
    from finetune.ui.workspace import Workspace

    workspace = Workspace(tmp_path / "ws")
    workspace.create()  # as `finetune ui` does

    def form(run_name="r1", launch_with=train_tab.ONE_PROCESS, learning_rate=FIELDS[2], extra=LONG_RUN):
        values = [*FIELDS[:2], learning_rate, *FIELDS[3:]]
        return train_tab.Form("quickstart", launch_with, run_name, dict(zip(LABELS, values)), extra)

    bad = train_tab.validate(workspace, form(learning_rate="fast"))
    assert not bad.ok and "train.learning_rate" in bad.message and "**learning rate**" in bad.field_error
    ok = train_tab.validate(workspace, form())
    assert ok.ok and ok.message == "✓ The recipe and its data are valid." and "builtin:greetings" in ok.report
    assert "Data checks\n  duplicates: 19 exact duplicate rows in 19 groups" in ok.report  # the builtin's repeats
    unnamed = train_tab.validate(workspace, form(run_name=""))
    assert f"output_dir: {workspace.root / 'runs' / 'run-'}" in unnamed.report  # an empty name: a fresh one
    garbled = train_tab.validate(workspace, form(extra="train.max_steps 2"))
    assert garbled.message == "⚠ more settings: 'train.max_steps 2' is not key=value"

    command = train_tab.preview(workspace, form(launch_with="cpu_ddp_2proc")).split(" \\\n    ")
    assert command[0] == f"finetune train {workspace.recipe_path('quickstart')}"
    assert "train.learning_rate=0.001" in command and command[-1] == "--accelerate-config cpu_ddp_2proc"
    plan = train_tab.plan_memory(workspace, form(launch_with="cpu_ddp_2proc"), "a10")
    assert "on NVIDIA A10 24 GB, DDP on 2 processes" in plan and "DDP gradient buckets" in plan and ": fits" in plan
    assert "Largest micro-batch that fits at max_length" in plan
    assert "Time plan: " in plan and "on 2 processes" in plan and "DDP: all-reduce of " in plan
    assert not any(workspace.runs.iterdir()) and not any(workspace.launches.iterdir())


def test_a_launched_run_outlives_the_panel_stops_and_resumes_through_gradio_client(tmp_path):
    workspace = tmp_path / "ws"
    panel = Panel(workspace)
    try:
        api = panel.client
        launched = api.predict("quickstart", "cpu_ddp_2proc", "r1", *FIELDS, LONG_RUN, api_name="/launch")
        assert "Launched **r1**" in launched[1]
        assert launched[4] == ""  # the next Launch takes a fresh name
        pid = json.loads((workspace / ".launches" / "r1.json").read_text())["pid"]

        # The panel goes away; the run does not; a new panel finds it and sees it progress.
        panel.close(signal.SIGKILL)
        assert not group_gone(pid)
        panel = Panel(workspace)
        api = panel.client
        first = wait_for(lambda: (s := api.predict("r1", api_name="/progress"))[1]["data"] and s)
        status, loss = first[0], first[1]
        assert "running" in status and "tokens/s" in status and "ETA" in status
        assert loss["columns"][:2] == ["step", "loss"] and loss["data"][0][1] > 0
        wait_for(lambda: len(api.predict("r1", api_name="/progress")[1]["data"]) >= 2)
        table = api.predict(None, api_name="/runs")[0]
        assert table["data"][0][:2] == ["r1", "running"]

        stopped = api.predict("r1", api_name="/stop")
        assert "r1 · stopped" in stopped and "Stop: stopped." in stopped
        assert group_gone(pid)  # no process of the run is left: not the launcher, not either DDP rank
        rows = (workspace / "runs" / "r1" / "progress.jsonl").read_text().splitlines()
        assert '"status": "stopped"' in rows[-1]

        # Two chat models loaded (the stopped run's and its base) make room for the resumed run.
        tuned, base, _, notice = api.predict("Hi.", "r1", "final", "", 1.0, 16, True, [], [], api_name="/chat")
        assert notice == "" and [m["role"] for m in tuned] == [m["role"] for m in base] == ["user", "assistant"]
        assert len(chat_workers(panel)) == 2
        resumed = api.predict("r1", api_name="/resume")
        assert "Resumed from its newest complete checkpoint (unloaded 2 chat models)" in resumed
        assert chat_workers(panel) == []
        step = json.loads(rows[-1])["step"]
        wait_for(lambda: max((row[0] for row in api.predict("r1", api_name="/progress")[1]["data"]), default=0) > step)
        card = api.predict("r1", api_name="/stop")
        # the resumed run planned its time from the speed the run measured before its stop (the Live tab shows it)
        assert "r1 · stopped" in card and "Time plan at the start: **" in card
        assert "tokens/s (2 processes sharing the CPU)" in card
        progress = [json.loads(line) for line in (workspace / "runs" / "r1" / "progress.jsonl").read_text().splitlines()]
        assert [row["resumed"]["from"] for row in progress if "resumed" in row] == [f"checkpoint-{step}"]
    finally:
        panel.close()
        subprocess.run(["pkill", "-f", str(workspace)])  # a run left by a failed check would train on for minutes


def test_stop_forces_a_run_that_ignores_sigterm(tmp_path):
    from finetune.ui.workspace import Workspace

    workspace = Workspace(tmp_path)
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); " \
               "time.sleep(600)"
    pid = workspace.launch([sys.executable, "-c", stubborn], "stubborn")
    wait_for(lambda: "up" in (tmp_path / ".launches" / "stubborn.log").read_text(), timeout=30, every=0.2)
    assert workspace.run("stubborn").status == "starting"
    assert workspace.stop("stubborn", grace_s=1) == "killed"
    assert group_gone(pid) and workspace.run("stubborn").status == "failed"


def test_a_run_started_from_the_command_line_shows_running_and_stops(tmp_path):
    from finetune.ui.workspace import Workspace

    workspace = Workspace(tmp_path)
    workspace.create()
    run = tmp_path / "runs" / "from-cli"
    process = subprocess.Popen([sys.executable, "-m", "finetune", "train", "quickstart", f"output_dir={run}",
                                "method=lora", *LONG_RUN.splitlines()], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (run / "progress.jsonl").exists() and (run / "progress.jsonl").read_text().count("loss") >= 2)
    info = workspace.run("from-cli")
    assert info.status == "running" and not info.resumable
    assert workspace.stop("from-cli") == "stopped"
    assert process.wait(timeout=60) == 0
    info = workspace.run("from-cli")
    assert info.status == "stopped" and info.resumable


def test_stop_never_signals_a_process_group_that_is_no_longer_the_runs(tmp_path):
    """After a restart, a launch record's process id may belong to another program by now."""
    from finetune.training.launcher import start_time
    from finetune.ui.workspace import Workspace

    workspace = Workspace(tmp_path)
    workspace.create()
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        record = {"pid": stranger.pid, "leader_started": start_time(stranger.pid) - 1000,
                  "command": ["finetune", "train"], "started": time.time() - 3600}
        (tmp_path / ".launches" / "old.json").write_text(json.dumps(record))
        assert workspace.run("old").status == "failed"
        assert workspace.stop("old") == "not running"
        time.sleep(0.5)
        assert stranger.poll() is None  # untouched
    finally:
        stranger.kill()
        stranger.wait()


def chromium() -> str:
    pytest.importorskip("playwright", reason="playwright is not installed (pip install -e '.[test]')")
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does it)")
    return path


def test_browser_launches_a_run_and_sees_the_loss_plot(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    browser_path = chromium()
    workspace = tmp_path / "ws"
    panel = Panel(workspace)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                tempfile.mkdtemp(dir=tmp_path), executable_path=browser_path, headless=True,
                viewport={"width": 1400, "height": 1000},
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update"])
            page = context.new_page()
            page.goto(panel.url)
            run_name = page.get_by_label("Run name")
            run_name.fill("browser-run")
            page.get_by_label("More settings (key=value, one per line)").fill(LONG_RUN)
            page.get_by_role("button", name="Launch").click()
            page.get_by_text("Launched browser-run").wait_for(timeout=120_000)
            expect(run_name).to_have_value("")  # a second Launch takes a fresh name, never the first one's
            page.screenshot(path=ARTIFACTS / "panel-train.png", full_page=True)
            page.get_by_role("tab", name="Live").click()
            page.get_by_text("browser-run · running").wait_for(timeout=180_000)
            wait_for(lambda: len(list((workspace / "runs" / "browser-run").glob("progress.jsonl"))) and
                     (workspace / "runs" / "browser-run" / "progress.jsonl").read_text().count("\n") >= 3)
            page.wait_for_timeout(4000)  # two refreshes of the plot
            plot = page.locator(".vega-embed").first
            plot.wait_for(timeout=60_000)
            assert plot.locator("path, canvas").count() > 0
            page.screenshot(path=ARTIFACTS / "panel-live.png", full_page=True)
            page.get_by_role("button", name="Stop").click()
            page.get_by_text("browser-run · stopped").wait_for(timeout=180_000)
            page.get_by_role("tab", name="Runs").click()
            page.wait_for_timeout(2500)
            page.screenshot(path=ARTIFACTS / "panel-runs.png", full_page=True)
            context.close()
    finally:
        panel.close()
        subprocess.run(["pkill", "-f", str(workspace)])  # a run left by a failed check would train on for minutes
    assert (ARTIFACTS / "panel-live.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def quickstart_panel(quickstart_workspace, tmp_path_factory):
    """A panel over a workspace holding a copy of the quickstart's run (its tests write into the run and exports/)."""
    assert quickstart_workspace.result.returncode == 0, quickstart_workspace.result.stderr[-3000:]
    root = tmp_path_factory.mktemp("quickstart-panel")
    shutil.copytree(quickstart_workspace.run, root / "runs" / "quickstart")
    panel = Panel(root)
    yield root, panel.client
    panel.close()


def test_chat_answers_as_trained_beside_the_base_model(quickstart_panel):
    _, api = quickstart_panel
    tuned, base, kept, notice = api.predict("My name is Zorbel.", "quickstart", "final", "", 0.0, 48, True, [], [],
                                            api_name="/chat")
    assert notice == "" and kept == ""
    assert [m["role"] for m in tuned] == [m["role"] for m in base] == ["user", "assistant"]
    assert said(tuned[1]) == "Nice to meet you, Zorbel!"  # greedy: the trained answer, exactly
    assert said(base[1]) != said(tuned[1])  # the base model's random weights never learned it


def said(message: dict) -> str:
    """A chat message's text as the Gradio client hands it back: a string or a list of typed parts."""
    from finetune.ui.chat_tab import message_text

    return message_text(message["content"])


def test_export_through_the_panel_writes_a_checked_model(quickstart_panel):
    root, api = quickstart_panel
    exported, token_line = api.predict("quickstart", "final", "qs-bf16", False, "bf16", "", True, api_name="/export")
    assert "exported the model to" in exported and "checked: logits within" in exported
    assert (root / "exports" / "qs-bf16" / "model.safetensors").is_file()
    assert token_line.startswith("Hub token:")
    refused, _ = api.predict("quickstart", "final", "../outside", False, "bf16", "", True, api_name="/export")
    assert "export name '../outside'" in refused and not (root / "outside").exists()


def test_panel_evaluates_models_side_by_side_and_shows_samples(quickstart_panel):
    """The quickstart's run in a panel's workspace: its Live tab shows the answers of the last two evaluations, and
    the Evaluate tab puts the trained model beside its base on unseen names."""
    root, api = quickstart_panel
    run = root / "runs" / "quickstart"
    samples = api.predict("quickstart", api_name="/progress")[3]
    steps = [int(row["step"]) for row in map(json.loads, (run / "progress.jsonl").read_text().splitlines())
             if "samples" in row]
    assert samples["headers"] == ["prompt", "reference", f"step {steps[-1]}", f"step {steps[-2]}"]
    assert len(samples["data"]) == 4 and all(row[1] == row[2] for row in samples["data"])

    message, table, answers = api.predict(["quickstart", "base:quickstart"], "builtin:unseen-names",
                                          ["exact_match", "rouge_l"], 48, 20, api_name="/evaluate")
    assert message == "Evaluated 2 models on 20 examples."
    assert table["headers"] == ["metric", "quickstart", "base:quickstart"]
    rows = {row[0]: row[1:] for row in table["data"]}
    assert set(rows) == {"loss", "perplexity", "exact_match", "rouge_l", "stop_rate", "mean_length"}
    assert rows["exact_match"][1] == "0.0%" and float(rows["exact_match"][0].rstrip("%")) >= 90
    assert rows["stop_rate"] == ["100.0%", "0.0%"]
    assert answers["headers"] == ["prompt", "reference", "quickstart", "base:quickstart"]
    first = answers["data"][0]
    assert first[0].startswith("My name is ") and first[2] == first[1] and first[3].endswith(" …")
    refused = api.predict(["../x"], "builtin:unseen-names", ["exact_match"], 32, 5, api_name="/evaluate")
    assert refused[0].startswith("⚠ run name '..': use letters")
