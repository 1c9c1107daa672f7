"""huggingface_hub and datasets (1.x, 4.x): going offline in a running process. Both read HF_HUB_OFFLINE once, when
they are imported; a process that finds out afterwards that the Hub cannot be reached, and loads a cached name, sets
the values they read, or each load would try the network for most of a minute first."""

from __future__ import annotations

import os
import sys


def stay_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")  # imported already: it read the setting then
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
