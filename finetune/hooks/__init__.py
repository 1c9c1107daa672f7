"""Where the toolkit reaches into a library's private parts, one module per library, each hook with the reason no
public API serves. The modules of the libraries this project pins check at import that the installed release is
the one their hooks were read against, and name their hooks when it is not."""

from __future__ import annotations

import importlib.metadata
import warnings


def check_pin(distribution: str, pinned: str, hooks: tuple[str, ...]) -> None:
    """A warning naming `hooks` when the installed `distribution` is not the `pinned` release (major.minor)."""
    try:
        installed = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return
    if installed.split(".")[:2] != pinned.split(".")[:2]:
        warnings.warn(f"finetune reaches into {distribution} {pinned}'s private {', '.join(hooks)}, and {distribution} "
                      f"{installed} is installed: these may have changed (pip install -e . installs {pinned})",
                      stacklevel=2)
