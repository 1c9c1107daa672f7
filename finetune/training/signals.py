"""Stop requests: SIGTERM or Ctrl-C ask a run to stop at the end of the current step, with a checkpoint.

A second Ctrl-C stops a lone process at once. A process started by a launcher (torch's elastic agent, under
`accelerate launch`) treats every SIGINT and SIGTERM as the same request: the agent forwards the signals it gets,
so one Ctrl-C or one scheduler signal can arrive twice, and the hard stop belongs to whoever supervises the
processes (`finetune train --accelerate-config`, or the agent's own shutdown timeout).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

logger = logging.getLogger("finetune")


def under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


class StopRequest:
    """Installs its handlers for as long as it is entered; `requested` says whether a stop was asked for.

    Where no handler can be installed (a Ray Train worker runs `run()` in a thread), the request is the file
    `marker` (the run folder's .stop, written by the Ray launch when it is asked to stop)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, marker: Path | None = None):
        self.asked = False
        self.marker = marker
        self._watch_marker = False
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.asked or (self._watch_marker and self.marker.exists())

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            self._watch_marker = self.marker is not None
            return self
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.asked and signum == signal.SIGINT and not under_launcher():
            raise KeyboardInterrupt
        if not self.asked:
            logger.warning("stop requested: saving a checkpoint at the end of this step")
        self.asked = True
