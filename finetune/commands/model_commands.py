"""The commands that work on trained models: `finetune chat`, `serve`, `eval` and `export`, and the panel
(`finetune ui`).
`cli.py` defines their options; heavy libraries load inside each command."""

from __future__ import annotations

import os
import sys

from finetune.errors import UserError
from finetune.trained_model.evaluate import DEFAULT_METRICS
from finetune.trained_model.served_models import MAX_REQUEST_MB

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def ui_command(args) -> int:
    loopback = args.host in LOOPBACK
    if (args.share or not loopback) and not args.auth:
        where = "--share" if args.share else f"--host {args.host}"
        raise UserError(f"{where} makes the panel reachable from other machines, and it can start processes: "
                        "add --auth USER:PASSWORD, or keep the default host 127.0.0.1")
    auth = None
    if args.auth:
        user, sep, password = args.auth.partition(":")
        if not sep or not user or not password:
            raise UserError("--auth: write it USER:PASSWORD")
        auth = (user, password)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before Gradio loads: no telemetry, no version check
    try:
        from finetune.ui.app import CSS, build_app
    except ImportError as error:
        raise UserError(f"the panel needs its extra ({error.name} is missing): pip install -e \".[ui]\"") from None
    from finetune.ui.workspace import Workspace

    workspace = Workspace(args.workspace)
    workspace.create()
    app = build_app(workspace).queue()
    # quiet: Gradio's own start-up lines advise `share=True in launch()`; ours names the flags a user has
    app.launch(server_name=args.host, server_port=args.port, share=args.share, auth=auth, css=CSS, footer_links=[],
               quiet=True, prevent_thread_lock=True)
    print(f"finetune panel on {app.local_url}" + (f" and {app.share_url}" if app.share_url else "")
          + f", workspace {workspace.root} (Ctrl-C stops it; the runs it launched go on)", flush=True)
    app.block_thread()
    return 0


def serve_command(args) -> int:
    api_key = args.api_key or os.environ.get("FINETUNE_API_KEY")
    if args.host not in LOOPBACK and not api_key:
        raise UserError(f"--host {args.host} makes the models answer other machines: add --api-key KEY (or set "
                        "FINETUNE_API_KEY), which clients send as their bearer token, or keep the default host "
                        "127.0.0.1")
    if args.engine == "vllm":
        from finetune.trained_model import vllm_engine

        if args.max_request_mb != MAX_REQUEST_MB:
            raise UserError("--max-request-mb is the transformers engine's; vLLM's server sets its own limits")
        return vllm_engine.serve(args.targets, args.host, args.port, api_key)
    try:
        from finetune.trained_model import server
    except ImportError as error:
        raise UserError(f"the server needs FastAPI and Uvicorn ({error.name} is missing): pip install -e "
                        "\".[serve]\"") from None
    _quiet_loading()
    return server.serve(args.targets, args.host, args.port, api_key, args.max_request_mb)


def chat_command(args) -> int:
    from finetune.trained_model.chat import Chat, Piece, Sampling

    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UserError("--max-new-tokens must be at least 1, --temperature at least 0, --top-p in (0, 1]")
    _quiet_loading()
    chat = Chat(args.path, args.base_model)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    system = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        for piece in chat.stream([*system, {"role": "user", "content": args.prompt}], sampling):
            if isinstance(piece, Piece) and piece.kind == "answer":
                print(piece.text, end="", flush=True)
        print()
        return 0
    print(f"chatting with {chat.folder.path}; /reset clears the history, /exit or Ctrl-D quits", flush=True)
    history: list[dict] = []
    while True:
        try:
            text = input("\nyou> ")
        except EOFError:
            print()
            return 0
        if text.strip() in ("/exit", "/quit"):
            return 0
        if text.strip() == "/reset":
            history = []
            continue
        history.append({"role": "user", "content": text})
        shown = None
        for piece in chat.stream([*system, *history], sampling):
            if isinstance(piece, Piece):
                if piece.kind != shown:
                    print("\nreasoning> " if piece.kind == "thinking" else "\nassistant> ", end="")
                    shown = piece.kind
                print(_dim(piece.text) if piece.kind == "thinking" else piece.text, end="", flush=True)
            else:
                turn = {"role": "assistant", "content": piece.answer}
                if piece.thinking:
                    turn["thinking"] = piece.thinking
                history.append(turn)
                if piece.ended_by is None:
                    print(f"\n[cut at --max-new-tokens {args.max_new_tokens}]", end="")
        print(flush=True)


def _check_parity(args) -> int:
    from finetune.trained_model import parity

    if args.path or args.out:
        raise UserError("--check TARGET writes nothing: give it without PATH and --out")
    _quiet_loading()
    places = parity.check(args.check)
    print(parity.table(places))
    return 1 if any(place.differences for place in places) else 0


def export_command(args) -> int:
    from finetune.trained_model import saved_model
    from finetune.trained_model.export import export
    from finetune.trained_model import gguf

    if args.check:
        return _check_parity(args)
    if not (args.path and args.out):
        raise UserError("export needs a PATH and --out DIR (or --check TARGET alone)")
    if args.private and not args.push_to_hub:
        raise UserError("--private applies to --push-to-hub REPO, which is missing")
    run = saved_model.locate(args.path).run
    if args.register:
        from finetune.mlflow_store import check_store

        check_store(run or args.out, None, "--register")
    _quiet_loading()
    gguf_type = args.gguf_type or (gguf.OF_DTYPE[args.dtype] if args.gguf else None)
    result = export(args.path, args.out, merge=args.merge, dtype=args.dtype, base_model=args.base_model,
                    push_to_hub=args.push_to_hub, private=args.private, gguf_type=gguf_type, license=args.license)
    check = ("logits identical to the trained model's" if result.tolerance == 0 else
             f"logits within {result.tolerance:g} of the largest at {result.positions_within} of "
             f"{result.positions} positions, largest difference {result.max_difference:.2g}")
    print(f"exported the {result.what} to {result.folder} (checked: {check})")
    if result.gguf:
        print(f"gguf: {result.gguf} (checked by llama.cpp: {gguf.summary(result.gguf_report)})")
        made = result.gguf_report["ollama"]
        print(f"ollama: {result.folder / made} (ollama create NAME -f {result.folder / made})" if made == "Modelfile"
              else f"ollama: {made}")
    if result.url:
        print(f"pushed: {result.url}")
    if args.register:
        from finetune.mlflow_store import open_command
        from finetune.training.tracking import register

        version, uri = register(result.folder, args.register, run)
        print(f"registered: {args.register} version {version} in {uri} (open it with: {open_command(uri)})")
    return 0


def eval_command(args) -> int:
    from pathlib import Path

    from finetune.trained_model.evaluate import Settings, evaluate, table

    if args.max_new_tokens < 1 or args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise UserError("--max-new-tokens, --batch-size and --limit must be at least 1")
    columns = {}
    for item in args.columns:
        name, sep, column = item.partition("=")
        if not sep or not name or not column:
            raise UserError(f"--columns {item}: write FIELD=COLUMN, e.g. instruction=question")
        columns[name] = column
    settings = Settings(args.data, args.metric or list(DEFAULT_METRICS), args.extract, args.max_new_tokens,
                        args.batch_size, args.limit, [t.strip() for t in (args.tasks or "").split(",") if t.strip()],
                        args.include_tasks, args.format, columns)
    out = Path(args.out) if args.out else None
    if args.server:
        import os

        from finetune.trained_model.endpoint_eval import evaluate_endpoint

        if args.targets or not args.model:
            raise UserError("--server URL evaluates the models it serves: name them with --model NAME, and no "
                            "TARGET beside it")
        results = evaluate_endpoint(args.server, args.model, settings, args.api_key or os.environ.get("OPENAI_API_KEY"),
                                    out)
    elif not args.targets or args.model:
        raise UserError("name the trained models to evaluate (TARGET ...), or an endpoint with --server URL --model "
                        "NAME")
    else:
        _quiet_loading()
        results = evaluate(args.targets, settings, out)
    print(table(results))
    for result in results:
        if result.kept:
            print(f"{result.target}: answers in {', '.join(map(str, result.kept))}")
    return 0


def _quiet_loading() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _dim(text: str) -> str:
    return f"\033[2m{text}\033[0m" if sys.stdout.isatty() else text
