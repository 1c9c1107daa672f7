"""What launchers start: `accelerate launch --config_file accelerate_configs/NAME.yaml -m finetune.train RECIPE
[key=value ...]` is `finetune train RECIPE [key=value ...]` in every process."""

import sys

from finetune.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
