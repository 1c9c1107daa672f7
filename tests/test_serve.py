"""`finetune serve` with real clients: the official `openai` client, eight streaming clients at once, raw HTTP for
the requests a client library would not send. The quickstart model (full fine-tune) is served beside two LoRA
adapters trained on it, "red" and "blue", and the base they share through one adapter's template."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import cli_here, train_here
from tests.test_readme import PAGES, commands

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai", reason="the test extra's openai client is not installed")

NAMES = ["Zorbel", "Christopher", "Maximilian", "Ann", "Bo", "Alexandra Rose"]


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def adapter_run(folder: Path, base: Path, color: str) -> Path:
    """A LoRA adapter on the quickstart model that answers every prompt with one color."""
    rng = random.Random(0)
    data = folder / f"{color}.jsonl"
    prompts = ["Pick a color.", "Name a color.", "Which color?", "Say a color.", "A color, please."]
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": rng.choice(prompts)},
                                                     {"role": "assistant", "content": color}]}) + "\n"
                            for _ in range(128)))
    run = folder / color
    result = train_here("quickstart", f"model.name_or_path={base}", "method=lora", f"data.train={data}",
                        "data.eval_fraction=0", "train.eval_on_start=false", "train.max_steps=30",
                        "train.learning_rate=3e-3", "train.per_device_train_batch_size=8", "train.save_strategy=no",
                        "train.lr_scheduler_type=constant", "train.warmup_steps=0", f"output_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def server(quickstart_workspace, gpt_oss_greeter, tmp_path_factory):
    """`finetune serve` on five targets, three of them on one loaded base; its log checked for tracebacks after."""
    assert quickstart_workspace.result.returncode == 0, quickstart_workspace.result.stderr[-3000:]
    folder = tmp_path_factory.mktemp("serve")
    base = quickstart_workspace.run / "final"
    red, blue = (adapter_run(folder, base, color) for color in ("red", "blue"))
    port = free_port()
    log = open(folder / "server.log", "w")
    readme = shlex.split(next(c for c in commands() if c.startswith("finetune serve")))  # its run, and three more
    process = subprocess.Popen(
        [sys.executable, "-m", "finetune", *readme[1:], str(red), f"blue={blue}", f"base:{red}",
         f"greeter={gpt_oss_greeter}", "--port", str(port)],
        cwd=quickstart_workspace.folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None, (folder / "server.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            time.sleep(1)
    yield url, folder / "server.log"
    os.killpg(process.pid, signal.SIGINT)
    process.wait(timeout=60)
    log.close()
    assert "Traceback" not in (folder / "server.log").read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def ask(client, model: str, text: str, **settings):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                          temperature=0, **settings)


def test_the_quickstart_model_answers_a_name_it_never_saw(client, server):
    answer = ask(client, "quickstart", "My name is Zorbel.")
    [choice] = answer.choices
    assert choice.message.content == "Nice to meet you, Zorbel!" and choice.finish_reason == "stop"
    assert answer.usage.prompt_tokens > 0 and answer.usage.total_tokens == answer.usage.prompt_tokens + \
        answer.usage.completion_tokens
    assert {model.id for model in client.models.list()} == {"quickstart", "red", "blue", "red-base", "greeter"}
    streamed = list(ask(client, "quickstart", "Shout plimbo.", stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == "PLIMBO!"
    assert streamed[-1].choices[0].finish_reason == "stop"
    cut = ask(client, "quickstart", "My name is Zorbel.", max_tokens=3)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    stopped = ask(client, "quickstart", "My name is Zorbel.", stop=[", "])
    assert stopped.choices[0].message.content == "Nice to meet you" and stopped.choices[0].finish_reason == "stop"


def test_the_readme_calls_it_with_curl_and_the_openai_client(server):
    port = server[0].rsplit(":", 1)[1]
    curl = next(c for c in commands() if c.startswith("curl")).replace(":8000", f":{port}")
    answer = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=120)
    assert json.loads(answer.stdout)["choices"][0]["message"]["content"] == "Nice to meet you, Zorbel!"
    [python] = [block for block in re.findall(r"```python\n(.*?)```", PAGES, re.S) if "OpenAI(" in block]
    printed = subprocess.run([sys.executable, "-c", python.replace(":8000", f":{port}")], capture_output=True,
                             text=True, timeout=120)
    assert printed.stdout == "Nice to meet you, Zorbel!\n", printed.stderr[-2000:]


def test_two_adapters_and_their_base_answer_from_one_loaded_model(client, server):
    assert ask(client, "red", "Pick a color.").choices[0].message.content == "red"
    assert ask(client, "blue", "Pick a color.").choices[0].message.content == "blue"
    assert ask(client, "red-base", "My name is Bo.").choices[0].message.content == "Nice to meet you, Bo!"
    log = server[1].read_text()
    assert "serving red, blue, red-base on one base model" in log


def test_gpt_oss_reasoning_comes_back_apart_from_the_answer(client):
    """GPT-OSS's analysis channel is `reasoning_content`; the answer stops at <|return|>."""
    answer = ask(client, "greeter", "I am bob.")
    message = answer.choices[0].message
    assert (message.reasoning_content, message.content) == ("Greet.", "Hi!")
    assert answer.choices[0].finish_reason == "stop"
    deltas = [chunk.choices[0].delta for chunk in ask(client, "greeter", "I am al.", stream=True) if chunk.choices]
    reasoning = "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas)
    assert reasoning == "Greet." and "".join(delta.content or "" for delta in deltas) == "Hi!"


def test_tools_and_earlier_tool_calls_reach_the_template_as_training_wrote_them(client, gpt_oss_greeter):
    """A request's tools, and an earlier tool call with its arguments as the JSON string OpenAI clients send, are
    rendered as the training data's form renders them (arguments as an object): the same prompt tokens."""
    from finetune.trained_model import saved_model
    from finetune.trained_model.chat import renderer_of

    tools = [{"type": "function", "function": {"name": "wave", "description": "Wave at someone.", "parameters": {
        "type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]}}}]
    sent = [{"role": "user", "content": "Wave at bob."},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "wave", "arguments": json.dumps({"to": "bob"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "waved"}]
    trained = [sent[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "wave", "arguments": {"to": "bob"}}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "waved"}]
    folder = saved_model.locate(gpt_oss_greeter)
    renderer = renderer_of(folder, saved_model.load_tokenizer(folder))
    answer = client.chat.completions.create(model="greeter", messages=sent, tools=tools, max_tokens=1)
    assert answer.usage.prompt_tokens == len(renderer.prompt_ids(trained, tools))
    assert answer.usage.prompt_tokens > len(renderer.prompt_ids(trained, None))


def test_n_choices_and_a_seed_that_repeats_them(client):
    """Choice i samples from seed + i: the same as a request of its own with that seed. Asked of the red adapter on a
    greeting, which it never saw (its answers there are uncertain, so different seeds give different samples)."""
    settings = dict(model="red", messages=[{"role": "user", "content": "My name is Ann."}], temperature=2.0,
                    max_tokens=12)
    first, again = (client.chat.completions.create(**settings, n=3, seed=7) for _ in range(2))
    assert [c.index for c in first.choices] == [0, 1, 2]
    answers = [c.message.content for c in first.choices]
    assert answers == [c.message.content for c in again.choices]
    assert answers == [client.chat.completions.create(**settings, seed=7 + i).choices[0].message.content
                       for i in range(3)]
    assert len(set(answers)) > 1, answers


def test_eight_streaming_clients_at_once_get_the_answers_they_get_alone(client):
    requests = [*(("quickstart", f"My name is {name}.") for name in NAMES), ("red", "Pick a color."),
                ("blue", "Name a color.")]
    alone = [ask(client, model, prompt).choices[0].message.content for model, prompt in requests]
    together: list[str | None] = [None] * len(requests)

    def stream(index: int) -> None:
        model, prompt = requests[index]
        chunks = ask(client, model, prompt, stream=True)
        together[index] = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)

    threads = [threading.Thread(target=stream, args=(index,)) for index in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert together == alone == [*(f"Nice to meet you, {name}!" for name in NAMES), "red", "blue"]


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("body, status, said", [
    (b'{"model": "quickstart", "messages": [', 400, "not valid JSON"),
    (json.dumps({"model": "nobody", "messages": [{"role": "user", "content": "Hi"}]}).encode(), 404,
     "the model 'nobody' is not served here"),
    (json.dumps({"model": "quickstart", "messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"})
     .encode(), 400, "temperature"),
    (json.dumps({"model": "quickstart", "messages": "Hi"}).encode(), 400, "messages"),
    (json.dumps({"model": "quickstart", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0})
     .encode(), 400, "max_tokens"),
    (json.dumps({"model": "quickstart", "messages": [{"role": "user", "content": "Hi " * 5000}]}).encode(), 400,
     "the model takes"),
])
def test_bad_requests_get_an_openai_error_and_the_server_goes_on(server, client, body, status, said):
    code, answer = post(server[0], body)
    assert code == status and said in answer["error"]["message"], answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert ask(client, "quickstart", "Shout kiwi.").choices[0].message.content == "KIWI!"


def test_a_client_that_leaves_mid_stream_stops_only_its_own_answer(server, client):
    """Two long answers stream side by side; one client leaves after its first piece: its answer stops there (the
    server log says after how many tokens), the other's goes on to its full length."""
    def open_stream() -> object:
        request = urllib.request.Request(
            f"{server[0]}/v1/chat/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "quickstart", "messages": [{"role": "user", "content": "My name is Bo."}],
                             "stream": True, "max_tokens": 400, "ignore_eos": True, "temperature": 0}).encode())
        return urllib.request.urlopen(request, timeout=120)

    leaving, staying = open_stream(), open_stream()
    assert leaving.readline().startswith(b"data: ")
    leaving.close()
    chunks = [json.loads(line[6:]) for line in staying.read().decode().splitlines()
              if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    log = server[1].read_text()
    stopped = re.findall(r"a client left: its answer stopped after (\d+) of up to 400 tokens", log)
    assert stopped and int(stopped[-1]) < 400, log[-2000:]
    assert ask(client, "quickstart", "My name is Ann.").choices[0].message.content == "Nice to meet you, Ann!"


def test_keys_and_binds(tmp_path, capsys):
    """Beyond 127.0.0.1 only with a key, refused before anything loads; the key is checked as a bearer token."""
    from starlette.testclient import TestClient

    from finetune.trained_model.server import build_app

    code, _, err = cli_here(capsys, "serve", str(tmp_path), "--host", "0.0.0.0")
    assert code == 2 and "--host 0.0.0.0 makes the models answer other machines: add --api-key KEY" in err
    code, _, err = cli_here(capsys, "serve", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err
    http = TestClient(build_app({}, api_key="sesame"))
    assert http.get("/v1/models").status_code == 401
    refused = http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/v1/models", headers={"Authorization": "Bearer sesame"}).json() == {"object": "list", "data": []}
    assert http.get("/health").json() == {"status": "ok"}


def test_vllm_is_refused_here_and_would_serve_the_same_targets_as_trained(server, quickstart_workspace, tmp_path,
                                                                         llama_tokenizer, gptoss_tokenizer, capsys):
    """On this machine (no CUDA, no vLLM) --engine vllm says what is missing. Its command line serves the adapters on
    their one base, the key kept off it, through a template that renders prompts as training did, date included."""
    from finetune.data.render import Renderer
    from finetune.errors import UserError
    from finetune.trained_model.served_models import parse_targets
    from finetune.trained_model.vllm_engine import dated_template, vllm_command

    folder = server[1].parent
    code, _, err = cli_here(capsys, "serve", str(folder / "red"), "--engine", "vllm", "--api-key", "sesame")
    assert code == 2 and "--engine vllm needs a CUDA GPU and vLLM" in err and "this machine has no CUDA GPU" in err
    targets = parse_targets([str(folder / "red"), f"blue={folder / 'blue'}", f"base:{folder / 'red'}"])
    command = vllm_command(targets, "127.0.0.1", 8000, tmp_path / "template.jinja")
    option = {name: command[command.index(name) + 1] for name in ("--model", "--served-model-name", "--max-lora-rank")}
    assert option == {"--model": str(quickstart_workspace.run / "final"), "--served-model-name": "red-base",
                      "--max-lora-rank": "16"}
    assert command[command.index("--lora-modules") + 1:] == [f"red={folder / 'red' / 'final'}",
                                                              f"blue={folder / 'blue' / 'final'}"]
    assert "sesame" not in command and (tmp_path / "template.jinja").is_file()
    with pytest.raises(UserError, match="serves one base model per server, and these targets are on 2"):
        vllm_command(parse_targets([str(quickstart_workspace.run), str(folder / "red")]), "127.0.0.1", 8000,
                     tmp_path / "other.jinja")
    conversation = [{"role": "user", "content": "Hi"}]
    for tokenizer in (llama_tokenizer, gptoss_tokenizer):  # templates that read the date through strftime_now
        trained = Renderer(tokenizer, tokenizer.chat_template, "2024-07-26").render_text(
            {"messages": conversation}, add_generation_prompt=True)
        served = tokenizer.apply_chat_template(conversation, chat_template=dated_template(
            tokenizer.chat_template, "2024-07-26"), tokenize=False, add_generation_prompt=True)
        assert served == trained and ("26 Jul 2024" in served or "2024-07-26" in served)


def test_eval_scores_served_models_as_it_scores_them_here(server, quickstart_workspace, tmp_path, capsys):
    """`finetune eval --server` on the served quickstart model finds what `finetune eval` finds on its run: the same
    greedy answers, metrics and stop rate; the red adapter beside it answers "red" to the prompts it trained on."""
    from finetune.builtin import resolve_dataset
    from finetune.trained_model.evaluate import Settings, evaluate_one, load_examples, resolve_target

    data = tmp_path / "held-out.jsonl"
    data.write_text("\n".join(Path(resolve_dataset("builtin:greetings")).read_text().splitlines()[-12:]) + "\n")
    code, out, err = cli_here(capsys, "eval", "--server", f"{server[0]}/v1", "--model", "quickstart", "--model", "red",
                              "--data", str(data), "--max-new-tokens", "48", "--out", str(tmp_path / "evals"))
    assert code == 0, err
    served = {name: json.loads((tmp_path / "evals" / f"{name}.json").read_text()) for name in ("quickstart", "red")}
    target = resolve_target(str(quickstart_workspace.run))
    settings = Settings(str(data), ["exact_match", "contains"], max_new_tokens=48)
    here = evaluate_one(target, load_examples(str(data), target.saved.recipe.data), settings)
    answers = [json.loads(line) for line in (tmp_path / "evals" / "quickstart.answers.jsonl").read_text().splitlines()]
    assert [a["answer"] for a in answers] == [a["answer"] for a in here.answers]
    for metric in ("exact_match", "contains", "stop_rate"):
        assert served["quickstart"]["metrics"][metric] == here.metrics[metric], metric
    assert served["quickstart"]["metrics"]["stop_rate"] == 1.0 and "loss" not in served["quickstart"]["metrics"]
    assert "quickstart" in out and "red" in out
    # the red adapter, asked what it was trained on (color prompts), answers red every time
    colors = tmp_path / "colors.jsonl"
    colors.write_text("".join(json.dumps({"messages": [{"role": "user", "content": prompt},
                                                       {"role": "assistant", "content": "red"}]}) + "\n"
                              for prompt in ("Pick a color.", "Name a color.", "Which color?", "Say a color.")))
    code, _, err = cli_here(capsys, "eval", "--server", f"{server[0]}/v1", "--model", "red", "--data", str(colors),
                            "--max-new-tokens", "8", "--out", str(tmp_path / "colors"))
    assert code == 0, err
    red = [json.loads(line) for line in (tmp_path / "colors" / "red.answers.jsonl").read_text().splitlines()]
    assert [a["answer"] for a in red] == ["red"] * 4


def test_lm_evaluation_harness_reaches_the_server_through_its_own_client(server):
    """lm-evaluation-harness's local-chat-completions model (a client nobody here wrote) on the shipped task."""
    lm_eval = pytest.importorskip("lm_eval", reason="the eval extra is not installed")
    from lm_eval.tasks import TaskManager

    from finetune.resources import eval_tasks_dir

    output = lm_eval.simple_evaluate(
        model="local-chat-completions", tasks=["finetune_greetings"], apply_chat_template=True, limit=8,
        model_args=f"model=quickstart,base_url={server[0]}/v1/chat/completions,num_concurrent=4,max_retries=1,"
                   "tokenized_requests=False",
        task_manager=TaskManager(include_path=[str(eval_tasks_dir())], verbosity="ERROR"), verbosity="ERROR")
    assert output["results"]["finetune_greetings"]["exact_match,none"] >= 0.8


def test_one_clients_bad_value_never_fails_the_requests_batched_with_it(server):
    """Six requests at once, one with a seed no generator takes: that one is the sender's 400, before it joins a
    batch; the other five are answered."""
    answers = [None] * 6

    def send(index: int) -> None:
        answers[index] = post(server[0], json.dumps({
            "model": "quickstart", "messages": [{"role": "user", "content": f"My name is {NAMES[index]}."}],
            "temperature": 0, "seed": 2**70 if index == 2 else index}).encode())

    threads = [threading.Thread(target=send, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [code for code, _ in answers] == [200, 200, 400, 200, 200, 200]
    assert answers[2][1]["error"]["param"] == "seed"
    assert [answers[i][1]["choices"][0]["message"]["content"] for i in (0, 1, 3, 4, 5)] == \
        [f"Nice to meet you, {NAMES[i]}!" for i in (0, 1, 3, 4, 5)]


def test_a_body_over_the_limit_is_413_and_a_long_prompt_is_read_off_the_event_loop(server):
    started = time.monotonic()
    code, answer = post(server[0], json.dumps({"model": "quickstart", "messages": [
        {"role": "user", "content": "x" * 10_000_000}]}).encode())
    assert code == 413 and answer["error"]["code"] == "request_too_large" and time.monotonic() - started < 5
    import http.client

    host, port = server[0].removeprefix("http://").split(":")
    for size, status in ((5_000_000, 413), (100, 200)):  # sent in chunks, with no Content-Length
        body = json.dumps({"model": "quickstart", "messages": [{"role": "user", "content": "x" * size}],
                           "max_tokens": 2}).encode()
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        connection.request("POST", "/v1/chat/completions", body=(body[i:i + 65536] for i in range(0, len(body), 65536)),
                           headers={"Content-Type": "application/json"}, encode_chunked=True)
        assert connection.getresponse().status == status
    long = json.dumps({"model": "quickstart", "messages": [{"role": "user", "content": "hello world " * 250_000}]})
    result = {}
    reading = threading.Thread(target=lambda: result.update(answer=post(server[0], long.encode())))
    reading.start()
    waits = []
    while reading.is_alive():  # /health answers while the 3 MB prompt is rendered and tokenized
        started = time.monotonic()
        urllib.request.urlopen(f"{server[0]}/health", timeout=30).read()
        waits.append(time.monotonic() - started)
        time.sleep(0.05)
    assert result["answer"][0] == 400 and result["answer"][1]["error"]["code"] == "context_length_exceeded"
    assert waits and max(waits) < 0.5, waits


def test_what_the_openai_client_asks_for_is_done_or_refused_saying_so(client, server):
    assert client.models.retrieve("red").id == "red"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nobody")
    # logprobs: each answer token's, under the model; greedy picks the likeliest
    answer = ask(client, "quickstart", "Shout kiwi.", logprobs=True, top_logprobs=3)
    tokens = answer.choices[0].logprobs.content
    assert "".join(token.token for token in tokens).startswith("KIWI!")
    assert all(token.top_logprobs[0].token == token.token and len(token.top_logprobs) == 3 and token.logprob <= 0
               for token in tokens)
    # penalties change a greedy answer that repeats itself
    assert ask(client, "quickstart", "Repeat kiwi twice.").choices[0].message.content == "kiwi kiwi"
    assert ask(client, "quickstart", "Repeat kiwi twice.", frequency_penalty=2.0,
               presence_penalty=2.0).choices[0].message.content != "kiwi kiwi"
    # a conversation that ends with the assistant's words is continued, not answered anew
    prefilled = client.chat.completions.create(model="quickstart", temperature=0, messages=[
        {"role": "user", "content": "My name is Zorbel."}, {"role": "assistant", "content": "Nice to meet"}])
    assert prefilled.choices[0].message.content == " you, Zorbel!"
    # what is not implemented is a 400 that says so, never ignored
    for settings, said in [({"response_format": {"type": "json_object"}}, "response_format is not implemented"),
                           ({"logit_bias": {"5": 10}}, "logit_bias is not implemented")]:
        with pytest.raises(openai.BadRequestError, match=said):
            ask(client, "quickstart", "Hi", **settings)
    code, refused = post(server[0], json.dumps({"model": "quickstart", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x.png"}}]}]}).encode())
    assert code == 400 and "image_url parts are not supported: the models served here read text only" in \
        refused["error"]["message"]


def test_a_fault_in_one_rows_hand_over_ends_that_row_only():
    """In the batcher itself: a request whose own callback fails ends with an error; its batch-mate's answer is what
    it generates alone."""
    from transformers import AutoModelForCausalLM

    from finetune import builtin
    from finetune.trained_model.batching import Batcher, Request

    model = AutoModelForCausalLM.from_pretrained(builtin.resolve_model("builtin:tiny-llama"))
    ends = {}

    def request(name: str, decode) -> Request:
        return Request([5, 6, 7], 6, lambda token, reason: ends.update({name: reason}) if reason else None,
                       lambda ids: None, decode, stop=("never",))

    def broken(ids):
        raise RuntimeError("a caller's fault")

    batcher = Batcher(model, 0, adapters=False)
    alone = request("alone", str)
    batcher.submit(alone)
    wait_until = time.monotonic() + 60
    while "alone" not in ends and time.monotonic() < wait_until:
        time.sleep(0.05)
    failing, fine = request("failing", broken), request("fine", str)
    batcher.submit(failing)  # submitted together: generated as one batch
    batcher.submit(fine)
    batcher.close()  # after the batch it is generating
    assert ends == {"alone": "length", "failing": "error", "fine": "length"}
    assert fine.generated == alone.generated and len(fine.generated) == 6
