"""The panel's chat models: each in a ChatWorker process, loaded when a browser session first chats with it.

A model is shared by the sessions that chat with the same checkpoint, and unloaded when no session uses it any
more (a session lets its model go when it picks another or when its page closes), when nobody has chatted with it
for `idle_s`, when more than `limit` are loaded (the least recently used goes), and before a run is launched, whose
processes need the GPU memory. A session whose model was unloaded gets it loaded again with its next message.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class _Loaded:
    worker: object  # finetune.chat.ChatWorker
    sessions: set[str] = field(default_factory=set)
    used: float = field(default_factory=time.monotonic)


class ChatModels:
    def __init__(self, limit: int = 2, idle_s: float = 600):
        self.limit, self.idle_s = limit, idle_s
        self._loaded: dict[tuple[str, bool], _Loaded] = {}  # (model folder, base model?) -> its worker
        self._lock = threading.Lock()

    def get(self, session: str, folder, base: bool):
        """The worker for `session` to chat with `folder` (or, `base`, with the model it started from)."""
        from finetune.trained_model.chat import ChatWorker  # light: the model loads in the worker's own process

        key = (str(folder), base)
        with self._lock:
            for other, loaded in list(self._loaded.items()):  # the session's earlier choice of this kind
                if other != key and other[1] == base:
                    self._leave(other, loaded, session)
            loaded = self._loaded.get(key)
            if loaded is None or not loaded.worker.alive():
                self._make_room(self.limit - 1)
                loaded = self._loaded[key] = _Loaded(ChatWorker(folder, base=base))
            loaded.sessions.add(session)
            loaded.used = time.monotonic()
            return loaded.worker

    def loaded(self) -> list[tuple[str, bool]]:
        return list(self._loaded)

    def release_session(self, session: str) -> None:
        with self._lock:
            for key, loaded in list(self._loaded.items()):
                self._leave(key, loaded, session)

    def release_idle(self) -> None:
        with self._lock:
            now = time.monotonic()
            for key, loaded in list(self._loaded.items()):
                if now - loaded.used > self.idle_s:
                    self._close(key)

    def release_all(self) -> int:
        """Unload every model; returns how many were loaded."""
        with self._lock:
            count = len(self._loaded)
            self._make_room(0)
            return count

    def _leave(self, key, loaded: _Loaded, session: str) -> None:
        loaded.sessions.discard(session)
        if not loaded.sessions:
            self._close(key)

    def _make_room(self, keep: int) -> None:
        while len(self._loaded) > keep:
            self._close(min(self._loaded, key=lambda key: self._loaded[key].used))

    def _close(self, key) -> None:
        self._loaded.pop(key).worker.close()


def unloaded_note(count: int, why: str = "") -> str:
    """What the user reads when models were unloaded for a run: ` (unloaded 2 chat models)`, or nothing."""
    return f" (unloaded {count} chat model{'s' if count > 1 else ''}{why})" if count else ""
