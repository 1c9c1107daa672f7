"""`finetune doctor`: the environment report, and the DDP health check passing on two CPU processes and failing
clearly, naming the rank, when one rank disagrees or hangs."""

from __future__ import annotations

import os
import time

import pytest

from tests.conftest import cli_here, run_cli


def test_report_names_versions_pins_disk_and_token(tmp_path):
    result = run_cli("doctor", "--output-dir", str(tmp_path / "runs"),
                     env={**os.environ, "HF_TOKEN": "hf_secret_never_shown"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = result.stdout
    assert "torch 2.13.0" in report and "GPUs: none visible" in report
    assert "transformers: 5.17.0" in report and "trl: 1.14.2" in report and "bitsandbytes: 0.50.2" in report
    assert "unsloth (extra unsloth): not installed" in report and "Liger: not installed" in report
    assert f"output {tmp_path / 'runs'}: " in report and "GiB free" in report
    assert "Hub token: configured (not shown)" in report and "hf_secret" not in report


def test_ddp_check_passes_on_two_cpu_processes_and_its_bandwidth_feeds_the_time_plan(capsys):
    result = run_cli("doctor", "--ddp", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DDP health check passed: 2 processes (gloo), 5 steps with gradients and weights equal on every rank" \
        in result.stdout and "bus bandwidth" in result.stdout
    advice = result.stdout.strip().splitlines()[-1]
    assert advice.startswith("Plan a run's time on these devices with it: finetune estimate RECIPE --num-gpus 2 "
                             "--bus-gb-s ")
    bandwidth = advice.split()[-1]
    code, out, err = cli_here(capsys, "estimate", "quickstart", "--gpu", "a10", "--num-gpus", "2", "--bus-gb-s",
                              bandwidth)
    assert code == 0, err
    assert f"per step over the measured bus bandwidth ({float(bandwidth):,.1f} GB/s, --bus-gb-s)" in out


@pytest.mark.parametrize("fault, message", [
    ("disagree:1", "rank 1's weights differ from rank 0's after step 2"),
    ("hang:1", "rank 1 hangs (last heard in step 2) while rank 0 waits for it in step 3"),
])
def test_ddp_check_names_the_rank_that_disagrees_or_hangs(fault, message):
    started = time.monotonic()
    mark = f"doctor-{fault}-{os.getpid()}"  # tells this test's processes from any other doctor on the machine
    result = run_cli("doctor", "--ddp", "2", env={**os.environ, "FINETUNE_DOCTOR_FAULT": fault,
                                                    "FINETUNE_TEST_MARK": mark}, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"error: DDP health check failed: {message}" in result.stderr
    assert time.monotonic() - started < 60  # a hang is reported, never waited out
    assert processes_marked(mark) == []  # no worker outlives the check


def processes_marked(mark: str) -> list[int]:
    import psutil

    marked = []
    for process in psutil.process_iter(["environ", "status"]):
        environment = process.info["environ"] or {}
        if environment.get("FINETUNE_TEST_MARK") == mark and process.info["status"] != psutil.STATUS_ZOMBIE:
            marked.append(process.pid)
    return marked
