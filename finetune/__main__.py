import sys

from finetune.commands.cli import main

sys.exit(main())
