"""Locust users for npu-llm: the gateway's SSE chat API, Triton gRPC streaming and Triton HTTP generate_stream.

Each request's TTFT, inter-token latencies, TPOT and E2E latency are fired as locust events
(request type "METRIC"), so locust's UI and CSVs show them beside request counts and failures,
and kept as records for loadtest/report.py, which runs when a headless test stops.
"""
from __future__ import annotations

import json
import threading
import time
from functools import partial
from pathlib import Path
from urllib.parse import urlparse

import grpc.experimental.gevent as grpc_gevent

# Before anything touches gRPC: without it, tritonclient's streaming blocks the whole gevent loop.
grpc_gevent.init_gevent()

from locust import HttpUser, User, constant, events, task  # noqa: E402

from backend.gateway.client import infer_input  # noqa: E402
from backend.models.registry import DEFAULT_MODEL  # noqa: E402
from loadtest.prompts import PromptSource  # noqa: E402
from loadtest.records import RequestRecord, Timer  # noqa: E402

RECORDS: list[RequestRecord] = []
ACTIVE_USERS: list[tuple[float, int]] = []
_source: PromptSource | None = None


@events.init_command_line_parser.add_listener
def _arguments(parser):
    parser.add_argument("--prompt-len", default="128", help="prompt tokens: N or MIN:MAX")
    parser.add_argument("--max-tokens", default="64", help="output tokens: N or MIN:MAX (EOS ignored)")
    parser.add_argument("--dataset", default=None, help="JSONL of chat conversations instead of synthetic prompts")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the gateway's served model name")
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL, help="tokenizer for synthetic prompts")
    parser.add_argument("--triton-model", default="llm")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--out-dir", default="loadtest-report", help="where the report goes")


def source(environment) -> PromptSource:
    global _source
    if _source is None:
        from backend.engine.tokenizer import load_template_tokenizer
        from backend.models.registry import resolve_model

        o = environment.parsed_options
        _source = PromptSource(load_template_tokenizer(resolve_model(o.tokenizer)), o.prompt_len, o.max_tokens,
                               o.dataset)
    return _source


def sampling(prompt, dataset: bool) -> dict:
    return {"temperature": 0, "max_tokens": prompt.max_tokens, "ignore_eos": not dataset}


def finish(environment, record: RequestRecord) -> None:
    """Fire the record's metrics as locust events and keep it for the report."""
    RECORDS.append(record)
    if record.error or record.ttft is None:
        return
    fire = partial(environment.events.request.fire, request_type="METRIC", response_length=0, exception=None,
                   context={})
    fire(name="TTFT", response_time=record.ttft * 1000)
    fire(name="E2E", response_time=record.e2e * 1000)
    if record.tpot is not None:
        fire(name="TPOT", response_time=record.tpot * 1000)
    for gap in record.itls:
        fire(name="ITL", response_time=gap * 1000)


def stream_sse(user: HttpUser, path: str, body: dict, headers: dict, name: str, record: RequestRecord,
               on_event) -> None:
    """POST and read Server-Sent Events; on_event(event) counts tokens and says whether it carried content."""
    timer = Timer(record)
    with user.client.post(path, json=body, headers=headers, stream=True, catch_response=True, name=name) as response:
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {response.text[:200]}"
            response.failure(record.error)
        else:
            for line in response.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    record.error = error["message"] if isinstance(error, dict) else str(error)
                    response.failure(record.error)
                    break
                if on_event(event):
                    timer.chunk()
    finish(user.environment, record)


class ChatSSEUser(HttpUser):
    """Streams /v1/chat/completions through the OpenAI-compatible gateway."""

    wait_time = constant(0)

    @task
    def chat(self):
        o = self.environment.parsed_options
        prompt = source(self.environment).next()
        body = {"model": o.model, "messages": prompt.messages, "stream": True,
                "stream_options": {"include_usage": True}, **sampling(prompt, bool(o.dataset))}
        headers = {"Authorization": f"Bearer {o.api_key}"} if o.api_key else {}
        record = RequestRecord("gateway", 0)

        def on_event(event: dict) -> bool:
            if event.get("usage"):
                record.prompt_tokens = event["usage"]["prompt_tokens"]
                record.output_tokens = event["usage"]["completion_tokens"]
            return bool(event["choices"] and event["choices"][0]["delta"].get("content"))

        stream_sse(self, "/v1/chat/completions", body, headers, "/v1/chat/completions (SSE)", record, on_event)


class TritonHttpUser(HttpUser):
    """Streams Triton's generate_stream endpoint with the vLLM backend's inputs."""

    wait_time = constant(0)

    @task
    def generate(self):
        o = self.environment.parsed_options
        prompt = source(self.environment).next()
        body = {"text_input": prompt.text, "stream": True, "return_num_input_tokens": True,
                "return_num_output_tokens": True, "sampling_parameters": json.dumps(sampling(prompt, bool(o.dataset)))}
        record = RequestRecord("triton-http", 0)

        def on_event(event: dict) -> bool:
            record.prompt_tokens = event.get("num_input_tokens", record.prompt_tokens)
            record.output_tokens += event.get("num_output_tokens", 0)
            return bool(event.get("text_output"))

        stream_sse(self, f"/v2/models/{o.triton_model}/generate_stream", body, {}, "generate_stream (SSE)", record,
                   on_event)


class TritonGrpcUser(User):
    """Streams through tritonclient.grpc (the vLLM backend's inputs), as its clients do."""

    wait_time = constant(0)

    def on_start(self):
        import tritonclient.grpc as grpcclient

        parsed = urlparse(self.host if "://" in self.host else f"grpc://{self.host}")
        self.client = grpcclient.InferenceServerClient(parsed.netloc)

    def on_stop(self):
        self.client.close()

    @task
    def generate(self):
        o = self.environment.parsed_options
        prompt = source(self.environment).next()
        record = RequestRecord("triton-grpc", 0)
        done = threading.Event()

        def on_response(result, error):
            if error is not None:
                record.error = str(error)
                done.set()
                return
            names = {out.name for out in result.get_response().outputs}
            if result.as_numpy("text_output")[0]:
                timer.chunk()
            if "num_input_tokens" in names:
                record.prompt_tokens = int(result.as_numpy("num_input_tokens")[0])
            record.output_tokens += int(result.as_numpy("num_output_tokens")[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                done.set()

        inputs = [
            infer_input("text_input", prompt.text.encode()),
            infer_input("stream", True),
            infer_input("sampling_parameters", json.dumps(sampling(prompt, bool(o.dataset))).encode()),
            infer_input("return_num_input_tokens", True),
            infer_input("return_num_output_tokens", True),
        ]
        start = time.perf_counter()
        self.client.start_stream(callback=on_response)
        timer = Timer(record)
        self.client.async_stream_infer(o.triton_model, inputs, enable_empty_final_response=True)
        finished = done.wait(600)
        self.client.stop_stream()
        if not finished:
            record.error = "no final response within 600 s"
        self.environment.events.request.fire(
            request_type="gRPC", name="ModelStreamInfer", response_time=(time.perf_counter() - start) * 1000,
            response_length=record.output_tokens, exception=RuntimeError(record.error) if record.error else None,
            context={})
        finish(self.environment, record)


@events.test_start.add_listener
def _watch_users(environment, **_):
    import gevent

    source(environment)  # the tokenizer and prompts load now, not in the first user's first request

    def sample():
        while True:
            ACTIVE_USERS.append((time.time(), environment.runner.user_count if environment.runner else 0))
            gevent.sleep(1.0)

    environment.users_greenlet = gevent.spawn(sample)


@events.test_stop.add_listener
def _write_report(environment, **_):
    from loadtest.report import build_report

    greenlet = getattr(environment, "users_greenlet", None)
    if greenlet is not None:
        greenlet.kill()
    o = environment.parsed_options
    out = Path(o.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").write_text("".join(r.to_json() + "\n" for r in RECORDS))
    (out / "users.json").write_text(json.dumps(ACTIVE_USERS))
    settings = {
        "host": environment.host, "users": o.num_users, "spawn_rate": o.spawn_rate, "run_time": o.run_time,
        "user_classes": [u.__name__ for u in environment.user_classes], "prompt_len": o.prompt_len,
        "max_tokens": o.max_tokens, "dataset": o.dataset, "model": o.model,
    }
    summary = build_report(out, settings)
    print(f"npu-llm loadtest: report in {out / 'report.html'}; "
          f"{summary['requests']} requests, {summary['errors']} errors, "
          f"{summary['output_tokens_per_s']:.1f} output tokens/s", flush=True)
