"""`finetune serve` batched against one request at a time: requests per second with CLIENTS clients at once.

A quickstart run (the builtin tiny Llama, trained for a few steps here) is served by `finetune serve`; the same
prompts, each answered with exactly MAX_TOKENS tokens (greedy, end tokens ignored by a stop-free budget), go once
one after the other and once from CLIENTS threads at once. Target: batched at least 3x the requests per second.

    python benchmarks/serve.py [--clients 8] [--max-tokens 64] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TARGET = 3.0


def finetune(*args: str, cwd: Path, wait: bool = True):
    command = [sys.executable, "-m", "finetune", *args]
    if not wait:
        return subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                start_new_session=True)
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"finetune {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result


def ask(url: str, prompt: str, max_tokens: int) -> int:
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["usage"]["completion_tokens"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="finetune-serve-") as tmp:
        folder = Path(tmp)
        finetune("train", "quickstart", "train.max_steps=3", "train.save_strategy=no", "train.eval_strategy=no",
                 "train.eval_on_start=false", "output_dir=run", cwd=folder)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = finetune("serve", "tiny=run", "--port", str(port), cwd=folder, wait=False)
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=2)
                    break
                except OSError:
                    if server.poll() is not None:
                        raise SystemExit("the server exited") from None
                    time.sleep(1)
            prompts = [f"My name is {name}." for name in ("Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal")]
            prompts = (prompts * (args.clients // len(prompts) + 1))[:args.clients]
            ask(url, prompts[0], 4)  # warm-up
            started = time.perf_counter()
            alone = [ask(url, prompt, args.max_tokens) for prompt in prompts]
            alone_s = time.perf_counter() - started
            started = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                together = list(pool.map(lambda prompt: ask(url, prompt, args.max_tokens), prompts))
            together_s = time.perf_counter() - started
        finally:
            os.killpg(server.pid, signal.SIGINT)
            server.wait(timeout=60)
    results = {"clients": args.clients, "max_tokens": args.max_tokens, "tokens": sum(alone),
               "one_at_a_time_s": round(alone_s, 2), "batched_s": round(together_s, 2),
               "one_at_a_time_rps": round(len(prompts) / alone_s, 3),
               "batched_rps": round(len(prompts) / together_s, 3)}
    results["speedup"] = round(alone_s / together_s, 2)
    assert sum(together) == sum(alone)
    print(f"{args.clients} requests of {args.max_tokens} tokens: one at a time {alone_s:.2f} s "
          f"({results['one_at_a_time_rps']} requests/s), {args.clients} clients at once {together_s:.2f} s "
          f"({results['batched_rps']} requests/s): {alone_s:.2f} / {together_s:.2f} = {results['speedup']}x "
          f"(target: at least {TARGET:g}x)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if results["speedup"] >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
