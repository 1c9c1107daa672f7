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

logger = logging.getLogger("finetune")


def under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


class StopRequest:
    """Installs its handlers for as long as it is entered; `requested` says whether a stop was asked for."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self  # a Ray Train worker runs `run()` in a thread; Ray stops its workers itself
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT and not under_launcher():
            raise KeyboardInterrupt
        if not self.requested:
            logger.warning("stop requested: saving a checkpoint at the end of this step")
        self.requested = True
