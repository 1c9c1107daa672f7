"""Growing past one machine: two launchers (machine ranks 0 and 1) meet through c10d rendezvous on loopback and
train like one machine; the SLURM script starts one launcher per node with the right ranks."""

from __future__ import annotations

import os
import socket
import stat
import subprocess

import pytest

from tests.conftest import REPO, SHORT, launch_argv, run_cli
from tests.test_training import adapter, losses

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_train_like_one(tmp_path):
    port = free_port()
    launchers = [
        subprocess.Popen(
            [*launch_argv("multi_node_ddp", "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                          "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--mixed_precision",
                          "no"), "quickstart", f"output_dir={tmp_path / 'two-machines'}",
             "train.per_device_train_batch_size=2", *SHORT],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]
    for launcher in launchers:
        _, stderr = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, stderr[-3000:]
    one = run_cli("train", "quickstart", f"output_dir={tmp_path / 'one'}", "train.per_device_train_batch_size=4",
                  *SHORT)
    assert one.returncode == 0, one.stderr[-3000:]
    single, both = losses(tmp_path / "one"), losses(tmp_path / "two-machines")
    assert len(both) == 6 and max(abs(a - b) / abs(a) for a, b in zip(single, both)) <= 1e-4
    weights_one, weights_two = adapter(tmp_path / "one"), adapter(tmp_path / "two-machines")
    assert max((weights_one[k] - weights_two[k]).abs().max().item() for k in weights_one) <= 1e-5


def test_slurm_script_starts_one_launcher_per_node(tmp_path):
    """Run the batch script with stand-ins for srun (two nodes) and scontrol, and for accelerate, which records its
    arguments: every node launches with its own machine rank and the first node's address, and lets a checkpoint
    written after scancel take its time."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        # a long node list, as on a big cluster: more than a pipe holds, so a reader that stops early breaks it
        "scontrol": 'printf "gpu-node-a\\ngpu-node-b\\n"; seq 100000 | sed s/^/gpu-node-/\n',
        "srun": 'for node in 0 1; do SLURM_NODEID=$node "$@"; done\n',
        "accelerate": f'echo "$SLURM_NODEID $TORCH_ELASTIC_SHUTDOWN_TIMEOUT $*" >> {tmp_path / "launches.txt"}\n',
    }
    for name, body in stubs.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-node-[a-b]",
           "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8"}
    script = REPO / "accelerate_configs" / "slurm_multi_node.sbatch"
    subprocess.run(["bash", str(script), "gpt-oss-20b-lora", "train.num_train_epochs=2"], cwd=REPO, env=env,
                   check=True, timeout=60)
    launches = (tmp_path / "launches.txt").read_text().splitlines()
    assert len(launches) == 2
    for rank, line in enumerate(launches):
        node, shutdown_timeout, *args = line.split()
        assert node == str(rank)
        assert shutdown_timeout == "600"  # the launcher leaves a stopped run time for its checkpoint
        assert " ".join(args) == (
            "launch --config_file accelerate_configs/multi_node_ddp.yaml --num_machines 2 --num_processes 16 "
            f"--machine_rank {rank} --main_process_ip gpu-node-a --main_process_port 29500 "
            "-m finetune.train gpt-oss-20b-lora train.num_train_epochs=2")
