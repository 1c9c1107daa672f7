"""`finetune serve --engine vllm`: the same targets answered by vLLM's OpenAI-compatible server (CUDA only).

vLLM serves one base model per server, with LoRA adapters on it per request. Prompts are rendered as training
rendered them: the training chat template, with the training date written into it (vLLM's template variables are
JSON, and the templates read the date by calling `strftime_now`), and its template variables as vLLM's defaults.
GPT-OSS's analysis channel comes back as `reasoning_content` through vLLM's own harmony parser.
"""

from __future__ import annotations

import json
import re
import sys
from datetime import date
from pathlib import Path

from finetune.errors import UserError
from finetune.trained_model import saved_model

LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM accepts
DATE_CALL = re.compile(r"""strftime_now\(\s*(["'])(.*?)\1\s*\)""")


def vllm_command(targets, host: str, port: int, template_file: Path) -> list[str]:
    """vLLM's server command line for the targets (which must share one model), writing the chat template it reads
    to `template_file`. The API key goes in the environment (VLLM_API_KEY), never on the command line."""
    groups = {target.base_key if target.shares_base else target.folder.path for target in targets}
    if len(groups) > 1:
        raise UserError(f"--engine vllm serves one base model per server, and these targets are on {len(groups)}: "
                        "start one `finetune serve --engine vllm` for each, on its own --port")
    first = targets[0]
    adapters = [target for target in targets if target.folder.is_adapter and not target.base]
    itself = [target for target in targets if not target.folder.is_adapter or target.base]
    model = first.folder.base_model() if first.shares_base else str(first.folder.path)
    tokenizer = saved_model.load_tokenizer(first.folder)
    data = first.folder.recipe.data
    template_file.write_text(with_system_prompt(dated_template(tokenizer.chat_template, data.template_date),
                                                data.system_prompt), encoding="utf-8")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", itself[0].name if itself else f"{first.name}-base",
               "--host", host, "--port", str(port), "--chat-template", str(template_file),
               "--generation-config", "vllm"]  # sampling as the request says, not the checkpoint's defaults
    if data.template_kwargs:
        command += ["--default-chat-template-kwargs", json.dumps(data.template_kwargs)]
    if first.folder.recipe.method == "qlora":
        command += ["--quantization", "bitsandbytes"]
    if adapters:
        ranks = [json.loads((t.folder.path / saved_model.ADAPTER_CONFIG).read_text())["r"] for t in adapters]
        command += ["--enable-lora", "--max-loras", str(len(adapters)),
                    "--max-lora-rank", str(next(rank for rank in LORA_RANKS if rank >= max(ranks))),
                    "--lora-modules", *(f"{target.name}={target.folder.path}" for target in adapters)]
    if "<|channel|>" in (tokenizer.chat_template or ""):
        command += ["--reasoning-parser", "openai_gptoss"]
    return command


def dated_template(template: str, template_date: str) -> str:
    """The template with each `strftime_now(FORMAT)` it calls answered for the training date, by a macro that
    stands in for the function the serving library would give it."""
    fixed = date.fromisoformat(template_date)
    formats = sorted({match.group(2) for match in DATE_CALL.finditer(template)})
    if not formats:
        return template
    branches = "".join(f"{{%- {'if' if i == 0 else 'elif'} format == {json.dumps(f)} %}}{fixed.strftime(f)}"
                       for i, f in enumerate(formats))
    return f"{{%- macro strftime_now(format) %}}{branches}{{%- endif %}}{{%- endmacro %}}{template}"


def with_system_prompt(template: str, system_prompt: str | None) -> str:
    """The template putting the recipe's system prompt first where a conversation has none, as training did (vLLM
    renders the request's messages as they come)."""
    if not system_prompt:
        return template
    return ("{%- if messages and messages[0]['role'] not in ['system', 'developer'] %}{%- set messages = "
            f"[{{'role': 'system', 'content': {json.dumps(system_prompt)}}}] + messages %}}{{%- endif %}}{template}")


def serve(arguments: list[str], host: str, port: int, api_key: str | None) -> int:
    """Refuse where vLLM cannot run, check the targets, and run vLLM's server until it ends."""
    import os
    import subprocess
    import tempfile

    import torch

    from finetune.recipe.stage_sections import VLLM_VERSIONS, unusable_vllm
    from finetune.trained_model import served_models

    problems = [problem for problem in ("" if torch.cuda.is_available() else "this machine has no CUDA GPU",
                                        unusable_vllm()) if problem]
    if problems:
        raise UserError(f"--engine vllm needs a CUDA GPU and vLLM {VLLM_VERSIONS} (pip install -e \".[vllm]\"); "
                        f"{' and '.join(problems)}: serve with the default engine (--engine transformers)")
    targets = served_models.parse_targets(arguments)
    with tempfile.TemporaryDirectory(prefix="finetune-vllm-") as folder:
        command = vllm_command(targets, host, port, Path(folder) / "chat_template.jinja")
        print(f"serving {', '.join(target.name for target in targets)} through vLLM: {' '.join(command[1:])}",
              flush=True)
        return subprocess.run(command, env={**os.environ, **({"VLLM_API_KEY": api_key} if api_key else {})}).returncode
