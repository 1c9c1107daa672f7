"""Batched generation against one prompt at a time: what `finetune eval` and the samples during training gain.

The same greedy answers (`Chat.replies`, KV cache, left-padded batches) to the same GSM8K questions rendered with the
Llama 3.2 chat template, on the throughput benchmark's model (random-initialized Llama architecture, about 37M
parameters, the real 128k-token Llama 3.2 vocabulary), once with batch 1 and once with batch 16. A random model
never writes its end token, so every answer runs to --max-new-tokens and both ways generate the same tokens.

    python benchmarks/generation.py [--prompts 32] [--batch-size 16] [--max-new-tokens 64] [--json results.json]

Needs ../shared/assets (the Llama 3.2 tokenizer and GSM8K), or $FINETUNE_SHARED_ASSETS.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import MODEL_SIZES, gsm8k_rows, make_model  # noqa: E402  (the benchmarks share model and data)


def measure(chat, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> tuple[float, list]:
    chat.replies(prompts[:batch_size], max_new_tokens=4, batch_size=batch_size)  # warm-up
    started = time.perf_counter()
    replies = chat.replies(prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    return time.perf_counter() - started, replies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--size", choices=MODEL_SIZES, default="bench", help="tiny: a smoke run of the script")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.render import Renderer
    from finetune.trained_model.chat import Chat

    with tempfile.TemporaryDirectory() as folder:
        make_model(Path(folder), args.size)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    chat = Chat.of(model, tokenizer, Renderer(tokenizer, tokenizer.chat_template, "2024-07-26"))
    prompts = [chat.prompt_ids(row["messages"][:1]) for row in gsm8k_rows(args.prompts)]
    one_s, one = measure(chat, prompts, args.max_new_tokens, 1)
    batched_s, batched = measure(chat, prompts, args.max_new_tokens, args.batch_size)
    tokens = sum(len(reply.token_ids) for reply in batched)
    results = {
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "generated_tokens": tokens,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "one_at_a_time_s": round(one_s, 3), f"batch_{args.batch_size}_s": round(batched_s, 3),
        "one_at_a_time_tokens_per_s": round(tokens / one_s, 1),
        f"batch_{args.batch_size}_tokens_per_s": round(tokens / batched_s, 1),
        "speedup": round(one_s / batched_s, 2),
        "same_answers": [r.token_ids for r in one] == [r.token_ids for r in batched],
    }
    print(f"{len(prompts)} GSM8K prompts ({results['prompt_tokens'][0]}-{results['prompt_tokens'][1]} tokens), "
          f"{tokens} tokens generated, greedy")
    one_s, batched_s = results["one_at_a_time_s"], results[f"batch_{args.batch_size}_s"]  # printed as kept
    print(f"one at a time: {one_s:.2f} s ({results['one_at_a_time_tokens_per_s']} tokens/s)")
    print(f"batch {args.batch_size}:      {batched_s:.2f} s ({results[f'batch_{args.batch_size}_tokens_per_s']} tokens/s)")
    print(f"speedup: {one_s:.2f} / {batched_s:.2f} = {results['speedup']}x; same answers: {results['same_answers']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
