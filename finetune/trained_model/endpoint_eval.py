"""`finetune eval --server URL --model NAME`: any OpenAI-compatible endpoint (`finetune serve`, vLLM, a provider)
answers the same examples with the same metrics and stop rate as a trained model here, so a served fine-tune, its
base and another provider's model land in one table.

Greedy answers (temperature 0) through `POST /v1/chat/completions`, `--batch-size` requests in flight at once; an
answer stopped when the endpoint says `finish_reason: stop`, its length the endpoint's `completion_tokens`. An
endpoint has no logits to give: no loss or perplexity.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from finetune.errors import UserError
from finetune.recipe.sections import DataSection
from finetune.trained_model.evaluate import (
    Example,
    Result,
    Settings,
    check_metrics,
    load_examples,
    safe_name,
    score_answers,
    write_result,
)

TIMEOUT_S = 600


def evaluate_endpoint(url: str, models: list[str], settings: Settings, api_key: str | None = None,
                      out: Path | None = None, say=print) -> list[Result]:
    from finetune.answers import check_extraction

    check_metrics(settings.metrics)
    check_extraction(settings.extract)
    if settings.data is None or settings.tasks:
        raise UserError("--server evaluates on --data FILE; lm-evaluation-harness tasks reach an endpoint through "
                        "its own local-chat-completions model")
    data = DataSection(**({"format": settings.format} if settings.format else {}), columns=settings.columns)
    examples = [example for example in load_examples(settings.data, data, settings.limit)
                if example.prompt is not None]
    if any("messages" not in example.prompt for example in examples):
        raise UserError(f"--data {settings.data}: plain-text examples have no conversation to send to a chat "
                        "endpoint")
    base = url.rstrip("/").removesuffix("/v1")
    results = []
    for model in models:
        say(f"evaluating {model} at {base} ...")
        with ThreadPoolExecutor(settings.batch_size) as pool:
            answers = list(pool.map(lambda example: _answer(base, model, example, settings, api_key), examples))
        result = Result(f"{base} {model}", model, score_answers(answers, settings.metrics, settings.extract), answers)
        if out is not None:
            result.kept = [write_result(out / safe_name(model), result, settings)]
        results.append(result)
    return results


def _answer(base: str, model: str, example: Example, settings: Settings, api_key: str | None) -> dict:
    messages = [{"role": m["role"], "content": m.get("content") or "",
                 **({"reasoning_content": m["thinking"]} if m.get("thinking") else {})}
                for m in example.prompt["messages"]]
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": settings.max_new_tokens}
    if example.prompt.get("tools"):
        body["tools"] = example.prompt["tools"]
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise UserError(f"{base} answered {example.where} with HTTP {error.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as error:
        raise UserError(f"--server {base} cannot be reached: {getattr(error, 'reason', error)}") from None
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    users = [m for m in messages if m["role"] == "user"]
    return {"where": example.where, "prompt": users[-1]["content"] if users else "",
            "answer": message.get("content") or "", "reference": example.reference,
            "stopped": choice.get("finish_reason") == "stop",
            "tokens": (answer.get("usage") or {}).get("completion_tokens", 0),
            **({"thinking": message["reasoning_content"]} if message.get("reasoning_content") else {})}
