"""A small OpenAI-compatible server on loopback: tests and trying `bench-serve` without a GPU.

    python -m draftsmith.serve.stub --port 8000                       # deterministic stub
    python -m draftsmith.serve.stub --port 8001 --spec_k 3            # "with a drafter"
    python -m draftsmith.serve.stub --port 8002 --model assets/tiny-llama-sharegpt   # a real tiny model

Serves GET /v1/models, /metrics, /health and POST /v1/completions, /v1/chat/completions
(streaming SSE over chunked HTTP/1.1, or one JSON body). The stub generates `max_tokens`
tokens "w0 w1 ..." at one decode step every `step_s` seconds, slowed by `contention` per other
running request (a crude batch cost). With spec_k > 0 each step emits 1 + accepted tokens,
accepting a cyclic pattern of draft lengths, and exports vLLM's spec-decode counters, so a
benchmark can read acceptance from /metrics. `faults` is a cyclic schedule over requests:
ok, error (HTTP 500), stall (hangs after the first token), hang (never answers), drop (closes the
socket mid-stream), bad_json (HTTP 200 with a cut-off JSON body), bad_sse (a chunk that is not
JSON, mid-stream), bad_shape (a JSON chunk that is not an OpenAI chunk), forever (streams tokens
past max_tokens and never finishes). `echo_auth` makes error bodies and the malformed chunk quote
the request's Authorization header, as a careless server does: a client must not pass that on.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator, Optional

from ..compat import cache_kwargs, output_cache

FAULTS = ("ok", "error", "stall", "hang", "drop", "bad_json", "bad_sse", "bad_shape", "forever")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    stub: "StubServer"

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # clients that hang up are normal here
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _authorized(self) -> bool:
        """Like `vllm serve --api-key`: every /v1 request needs `Authorization: Bearer KEY`."""
        stub = self.server.stub
        if stub.api_key is None or not self.path.startswith("/v1") or \
                self.headers.get("Authorization") == f"Bearer {stub.api_key}":
            return True
        stub.unauthorized += 1
        self._send(401, b'{"error": {"message": "Unauthorized"}}')
        return False

    def do_GET(self) -> None:
        stub = self.server.stub
        if not self._authorized():
            return
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": stub.model_name, "object": "model"}]}).encode())
        elif self.path == "/metrics" and stub.expose_metrics:
            self._send(200, stub.metrics_text().encode(), "text/plain; version=0.0.4")
        elif self.path == "/health":
            self._send(200, b"{}")
        else:
            self._send(404, b'{"error": {"message": "not found"}}')

    def do_POST(self) -> None:
        stub = self.server.stub
        chat = self.path.rstrip("/") == "/v1/chat/completions"
        if not self._authorized():
            return
        if not chat and self.path.rstrip("/") != "/v1/completions":
            return self._send(404, b'{"error": {"message": "not found"}}')
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except (ValueError, json.JSONDecodeError):
            return self._send(400, b'{"error": {"message": "invalid JSON body"}}')
        fault = stub.next_fault()
        echo = f" (request had Authorization: {self.headers.get('Authorization')})" if stub.echo_auth else ""
        if fault == "error":
            msg = json.dumps({"error": {"message": "injected server error" + echo, "type": "InternalServerError"}})
            return self._send(500, msg.encode())
        if fault == "hang":
            stub.stop.wait(stub.stall_s)
            self.close_connection = True
            return
        if fault == "bad_json":
            return self._send(200, b'{"choices": [{"text": "w1 w2", "finish_reason": ')
        prompt = req["messages"][-1]["content"] if chat else req.get("prompt", "")
        max_tokens = int(req.get("max_tokens") or 16)
        pieces = stub.generate(prompt, max_tokens, chat)
        if not req.get("stream"):
            text = "".join(p for step in pieces for p in step)
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return self._send(200, json.dumps({"choices": [choice], "usage": {"completion_tokens": max_tokens}}).encode())

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        obj = "chat.completion.chunk" if chat else "text_completion"
        n_tokens = 0
        if fault == "forever":
            pieces = itertools.repeat(["w0 "])
        with stub.running():
            for i, step in enumerate(pieces):
                if stub.stop.wait(stub.step_time()):
                    return
                n_tokens += len(step)
                text = "".join(step)
                choice = {"index": 0, "finish_reason": None}
                choice.update({"delta": {"content": text}} if chat else {"text": text})
                self._chunk(b"data: " + json.dumps({"object": obj, "choices": [choice]}).encode() + b"\n\n")
                if i == 0 and fault == "stall":
                    stub.stop.wait(stub.stall_s)
                    self.close_connection = True
                    return
                if i == 1 and fault == "bad_sse":
                    self._chunk(b'data: {"choices": [{"index": 0, "delta": {"content": "' + echo.encode() + b'\n\n')
                if i == 1 and fault == "bad_shape":
                    self._chunk(b'data: {"choices": "w1"}\n\n')
                if i == 1 and fault == "drop":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
        last = {"index": 0, "finish_reason": "length"}
        last.update({"delta": {}} if chat else {"text": ""})
        self._chunk(b"data: " + json.dumps({"object": obj, "choices": [last]}).encode() + b"\n\n")
        if (req.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n_tokens,
                     "total_tokens": len(prompt.split()) + n_tokens}
            self._chunk(b"data: " + json.dumps({"object": obj, "choices": [], "usage": usage}).encode() + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")


class StubServer:
    """The server, run in a background thread; use as a context manager."""

    def __init__(self, port: int = 0, step_s: float = 0.002, contention: float = 0.0, spec_k: int = 0,
                 accept_pattern: tuple[int, ...] = (3, 1, 2, 0), faults: tuple[str, ...] = ("ok",),
                 stall_s: float = 3600.0, expose_metrics: bool = True, model_name: str = "stub",
                 generator: Optional[Callable[[str, int, bool], Iterator[str]]] = None, api_key: Optional[str] = None,
                 extra_metrics: str = "", echo_auth: bool = False):
        bad = [f for f in faults if f not in FAULTS]
        if bad:
            raise ValueError(f"unknown faults {bad}; use {FAULTS}")
        self.step_s, self.contention, self.spec_k = step_s, contention, spec_k
        self.accept_pattern = tuple(min(a, spec_k) for a in accept_pattern) if spec_k else (0,)
        self.faults, self.stall_s, self.expose_metrics = tuple(faults), stall_s, expose_metrics
        self.model_name, self.generator = model_name, generator
        self.api_key, self.unauthorized, self.extra_metrics = api_key, 0, extra_metrics
        self.echo_auth = echo_auth
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._requests = 0
        self._active = 0
        self.counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * spec_k, "generated": 0}
        self.httpd = _Server(("127.0.0.1", port), _Handler)
        self.httpd.stub = self
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "StubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.stop.set()  # releases stalled handlers
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    def next_fault(self) -> str:
        with self._lock:
            i, self._requests = self._requests, self._requests + 1
        return self.faults[i % len(self.faults)]

    @contextlib.contextmanager
    def running(self):
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    def step_time(self) -> float:
        return self.step_s * (1 + self.contention * max(self._active - 1, 0))

    def generate(self, prompt: str, max_tokens: int, chat: bool) -> Iterator[list[str]]:
        """Decode steps, each a list of token strings (1 + accepted drafts with spec_k > 0)."""
        tokens = (self.generator(prompt, max_tokens, chat) if self.generator
                  else (f"w{(len(prompt) + i) % 97} " for i in range(max_tokens)))
        tokens = iter(tokens)
        pattern = itertools.cycle(self.accept_pattern)
        while True:
            accepted = next(pattern)
            step = list(itertools.islice(tokens, accepted + 1))
            if not step:
                return
            with self._lock:
                c = self.counters
                c["generated"] += len(step)
                if self.spec_k:
                    c["drafts"] += 1
                    c["draft_tokens"] += self.spec_k
                    c["accepted"] += len(step) - 1
                    for j in range(len(step) - 1):
                        c["per_pos"][j] += 1
            yield step

    def metrics_text(self) -> str:
        """vLLM-style exposition (prometheus_client names counters NAME_total)."""
        c = self.counters
        lines = ["# TYPE vllm:generation_tokens counter",
                 f'vllm:generation_tokens_total{{model_name="{self.model_name}"}} {float(c["generated"])}']
        if self.spec_k:
            for name, key in (("num_drafts", "drafts"), ("num_draft_tokens", "draft_tokens"),
                              ("num_accepted_tokens", "accepted")):
                lines += [f"# TYPE vllm:spec_decode_{name} counter",
                          f'vllm:spec_decode_{name}_total{{engine="0",model_name="{self.model_name}"}} {float(c[key])}',
                          f'vllm:spec_decode_{name}_created{{engine="0",model_name="{self.model_name}"}} 1.7e9']
            lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="{self.model_name}",'
                      f'position="{j}"}} {float(v)}' for j, v in enumerate(c["per_pos"])]
        return "\n".join(lines) + "\n" + self.extra_metrics


def hf_generator(model_dir: str | Path) -> Callable[[str, int, bool], Iterator[str]]:
    """Greedy generation with a local (tiny) HF model, one decoded token string at a time.
    Requests are served one at a time (a lock): this is a functional server, not a fast one."""
    # why here: torch and transformers take seconds to import; the stub serves canned text without them
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    lock = threading.Lock()

    def generate(prompt: str, max_tokens: int, chat: bool) -> Iterator[str]:
        if chat and tok.chat_template:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        else:
            ids = tok.encode(prompt)
        ids = torch.tensor([ids or [tok.bos_token_id or 0]])
        with lock, torch.inference_mode():
            out, cache = model(input_ids=ids, use_cache=True), None
            for _ in range(max_tokens):
                cache = output_cache(out)
                nxt = int(out.logits[0, -1].argmax())
                yield tok.decode([nxt])
                out = model(input_ids=torch.tensor([[nxt]]), use_cache=True, **cache_kwargs(model, cache))
    return generate


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftsmith.serve.stub", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--step_s", type=float, default=0.01, help="seconds per decode step")
    p.add_argument("--contention", type=float, default=0.02, help="step slowdown per other running request")
    p.add_argument("--spec_k", type=int, default=0, help="draft tokens per step (0: no speculation)")
    p.add_argument("--faults", default="ok", help=f"comma-separated cyclic schedule of {','.join(FAULTS)}")
    p.add_argument("--model", default=None, help="serve a local HF model folder instead of the stub text")
    a = p.parse_args(argv)
    gen = hf_generator(a.model) if a.model else None
    with StubServer(port=a.port, step_s=a.step_s, contention=a.contention, spec_k=a.spec_k,
                    faults=tuple(a.faults.split(",")), generator=gen,
                    model_name=Path(a.model).name if a.model else "stub") as s:
        print(f"serving on {s.url} (Ctrl-C stops)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
