"""finetune: memory-efficient LLM fine-tuning with typed recipes, exact loss masks, TRL and PEFT."""

import logging

__version__ = "0.1.0"

# bitsandbytes warns at import, on CPUs with AVX512-BF16, that an optional kernel from the Hub is missing.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
