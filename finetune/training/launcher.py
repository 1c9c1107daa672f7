"""Starting `accelerate launch` for `finetune train --accelerate-config`, and looking after what it starts.

torch's elastic agent (inside `accelerate launch`) starts each training process in a session of its own. When the
agent itself is signalled, it passes the signal on and kills the processes 30 seconds later
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT), whether or not their checkpoint is written. So the agent is started in its own
session too, where a terminal's Ctrl-C or a group SIGTERM (the panel's Stop) does not reach it; this process takes
them and asks the training processes directly: the first request stops them at the end of the step with a
checkpoint however long it takes, a second Ctrl-C kills them at once.

Nothing heavy is imported here: the panel uses `process_tree` to stop a run whatever its processes are.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from finetune.run_folder import finish_unfinished

PR_SET_PDEATHSIG = 1  # prctl(2)


def supervise(command: list[str], run: str | Path) -> int:
    """Run the launcher command to its end; returns its exit status (130 after a hard stop)."""
    process = subprocess.Popen(command, start_new_session=True, preexec_fn=_stop_when_parent_dies(os.getpid()))
    stop = {"asked": False, "at_once": False}

    def on_signal(signum, frame):
        if stop["asked"] and signum == signal.SIGINT:
            stop["at_once"] = True
            for pid in [process.pid, *process_tree(process.pid)]:
                send(pid, signal.SIGKILL)
        elif not stop["asked"]:
            stop["asked"] = True
            print("stopping at the end of this step, with a checkpoint (Ctrl-C again stops at once)", flush=True)
            for pid in children(process.pid) or [process.pid]:  # none yet: nothing to save, the launcher goes
                send(pid, signal.SIGTERM)

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if code != 0:
        finish_unfinished(run, "interrupted" if stop["at_once"] else
                          f"a training process exited with status {code} (see {Path(run) / 'train.log'})")
    return 130 if stop["at_once"] else code


def _stop_when_parent_dies(parent: int):
    """For the launcher's child, before it starts: SIGTERM when this process dies, however it dies (SIGKILL too),
    so that the training processes stop, with a checkpoint, instead of training on for a job nobody watches."""
    def arrange() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # it died before the request was made
                os.kill(os.getpid(), signal.SIGTERM)

    return arrange


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    return _descendants(pid, recursive=False)


def process_tree(pid: int) -> list[int]:
    """Every process descended from `pid` (children, their children, ...), whatever session or group they are in."""
    return _descendants(pid, recursive=True)


def _descendants(pid: int, recursive: bool) -> list[int]:
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=recursive)]
    except psutil.NoSuchProcess:
        return []


def start_time(pid: int) -> float | None:
    """When the process started, to tell it from a later process with its id."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


def group_alive(group: int) -> bool:
    """Whether a process of the process group still runs. Zombies do not count: they hold nothing, and where nothing
    reaps orphans (a container's init) a run's ended helpers, multiprocessing's resource tracker among them, stay
    zombies in its group."""
    import psutil

    try:
        os.waitpid(group, os.WNOHANG)  # a group leader this process started, and that has ended, is reaped
    except ChildProcessError:
        pass
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == group:
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


def send(pid: int, signum: int) -> None:
    """Signal a process that may have ended meanwhile."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def send_group(group: int, signum: int) -> None:
    """Signal a process group that may have ended meanwhile."""
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        pass
