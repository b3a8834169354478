"""`draftsmith bench-serve`: load-test OpenAI-compatible endpoints over a concurrency sweep.

    draftsmith bench-serve --url http://127.0.0.1:8000/v1 --prompts mtbench
    draftsmith bench-serve --url http://h:8000/v1 --label plain --url_b http://h:8001/v1 --label_b eagle3

Per concurrency level c, `requests_per_level` streaming requests are sent with at most c in
flight. Per request: TTFT (send -> first content), TPOT ((end - first content) / (tokens - 1)),
token count from the server's `usage` (stream_options.include_usage), else from the number of
content chunks. Per level: p50/p90/p99 of TTFT, TPOT and latency, output tokens/s and
requests/s over the level's wall time (successful requests only), errors by kind, and the
speculative-decoding acceptance read from /metrics before and after the level (vLLM counters
or SGLang gauges; serve/metrics.py). A/B mode alternates the two endpoints level by level
(A B, then B A, ...) on the same prompts and reports B/A ratios.

Bounded: every request has a total deadline (`request_timeout_s`), every level a deadline
(`level_timeout_s`; what is left is cancelled and reported), a fixed request budget, and the
client talks only to the configured URLs (no proxies from the environment).
"""
from __future__ import annotations

import asyncio
import io
import json
import math
import os
import re
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Optional, Sequence
from urllib.parse import urlsplit, urlunsplit

from jsonargparse import ActionConfigFile
from tqdm import tqdm

from ..fileio import atomic_write_bytes, atomic_write_json, to_jsonable
from ..manifests import load_manifest, package_versions
from ..messages import DraftsmithError, log
from ..rundir import Ledger, stage_dir
from ..config import cli_parser
from ..data.readers import load_prompts
from .metrics import parse_prometheus, spec_window


@dataclass
class BenchServeConfig:
    """Load-test one OpenAI-compatible endpoint (or two, A/B) over a concurrency sweep."""

    url: str = "http://127.0.0.1:8000/v1"
    """Base URL of the OpenAI-compatible API (ending in /v1)."""
    url_b: Optional[str] = None
    """A/B mode: a second endpoint (e.g. the same model served with a drafter), run interleaved."""
    label: str = "A"
    """Name of `url` in the report."""
    label_b: str = "B"
    """Name of `url_b` in the report."""
    model: Optional[str] = None
    """Model name sent with each request; default: the first model of GET URL/models."""
    model_b: Optional[str] = None
    """Model name for url_b; default: the first model of GET URL_B/models."""
    api: Literal["chat", "completions"] = "chat"
    """chat: /chat/completions with the prompt as one user message; completions: raw prompt."""
    prompts: str = "mtbench"
    """Prompt set: mtbench, humaneval, sharegpt, or a .jsonl file (first user turn of each record)."""
    max_prompts: int = 1000
    """Read at most this many prompts (cycled when a level needs more requests)."""
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128])
    """Concurrency levels (requests in flight)."""
    requests_per_level: int = 0
    """Requests per level; 0 = max(16, 4 x concurrency)."""
    max_tokens: int = 256
    """max_tokens of each request."""
    temperature: Optional[float] = None
    """Sampling temperature of each request; default: the one `run_dir`'s evaluate measured at (so the
    served figures stand beside evaluate's; recipes/gpu.yaml samples at 1), else 0 (greedy)."""
    ignore_eos: bool = False
    """Send ignore_eos (vLLM, SGLang) so every request generates max_tokens tokens."""
    request_timeout_s: float = 300.0
    """Total deadline of one request (connect to last byte)."""
    level_timeout_s: float = 900.0
    """Deadline of one level; requests still running are cancelled and reported."""
    warmup_requests: int = 2
    """Requests sent (sequentially, not measured) to each endpoint before the sweep."""
    metrics_url: Optional[str] = None
    """Prometheus endpoint of `url`; default SERVER_ROOT/metrics; `none` disables."""
    metrics_url_b: Optional[str] = None
    """Prometheus endpoint of `url_b` (same defaults)."""
    out_dir: Optional[str] = None
    """Where results.json and bench_serve.png go; default RUN_DIR/bench_serve, else ./bench_serve."""
    run_dir: Optional[str] = None
    """Run directory whose ledger records the figures (for status and plan)."""
    seed: int = 0
    """Shuffles the prompt order (the same order for every level and endpoint)."""
    progress: bool = True
    """Show a progress bar."""
    api_key_env: Optional[str] = None
    """Name of an environment variable holding the servers' API key (`vllm serve --api-key`,
    SGLang's --api-key), sent as `Authorization: Bearer KEY`. The key itself never goes on the
    command line, and it is redacted (with any user:password in a URL) from every output."""


@dataclass
class Endpoint:
    label: str
    url: str
    model: str = ""
    metrics_url: Optional[str] = None


@dataclass
class RequestResult:
    ok: bool
    latency_s: float
    ttft_s: Optional[float] = None
    output_tokens: int = 0
    tokens_from: str = "chunks"
    error: Optional[str] = None

    @property
    def tpot_s(self) -> Optional[float]:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


# ----------------------------------------------------------------------------- credentials

REDACTED = "***"
_SECRET_QUERY = re.compile(r"(?i)([?&](?:api[_-]?key|key|token|access_token|secret|password|auth)=)[^&#\s]*")


def redact_url(url: Optional[str]) -> Optional[str]:
    """`url` without credentials: user:password@ becomes ***@, secret query values ***."""
    if not url:
        return url
    try:
        u = urlsplit(url)
    except ValueError:
        return REDACTED
    netloc = u.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rsplit('@', 1)[1]}"
    return _SECRET_QUERY.sub(lambda m: m.group(1) + REDACTED, urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment)))


def secrets_of(cfg: "BenchServeConfig", api_key: Optional[str]) -> list[str]:
    """Every credential string the run knows: the API key, and the user info / secret query values of its URLs."""
    out = [api_key] if api_key else []
    for u in (cfg.url, cfg.url_b, cfg.metrics_url, cfg.metrics_url_b):
        if not u:
            continue
        try:
            parts = urlsplit(u)
        except ValueError:
            continue
        if "@" in parts.netloc:
            info = parts.netloc.rsplit("@", 1)[0]
            out += [info, *info.split(":", 1)]
        out += [m.group(0)[len(m.group(1)):] for m in _SECRET_QUERY.finditer("?" + parts.query.replace("&", "&"))]
    return sorted({s for s in out if s and len(s) >= 3}, key=len, reverse=True)


def redact(obj: Any, secrets: list[str]) -> Any:
    """`obj` (JSON-like) with every URL's credentials and every known secret string replaced by ***."""
    if isinstance(obj, dict):
        return {k: redact(v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v, secrets) for v in obj]
    if isinstance(obj, str):
        s = obj
        if "://" in s:
            s = re.sub(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]*[^\s'\"<>:;,.)]", lambda m: redact_url(m.group(0)) or "", s)
        for secret in secrets:
            s = s.replace(secret, REDACTED)
        return s
    return obj


def api_key_from_env(name: Optional[str]) -> Optional[str]:
    """The API key in environment variable `name` (None when no name is given)."""
    if not name:
        return None
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):  # most likely the key itself: not repeated here
        raise DraftsmithError("--api_key_env: the value given is not an environment variable name (letters, digits, _); "
                              "give the NAME of the variable that holds the key, e.g. export SERVE_KEY=... and "
                              "--api_key_env SERVE_KEY, never the key")
    key = os.environ.get(name)
    if not key:
        raise DraftsmithError(f"--api_key_env {name}: the environment variable {name} is not set or empty; "
                              f"export {name}=YOUR_KEY (the key never goes on the command line)")
    return key


# ----------------------------------------------------------------------------- one request


def request_body(api: str, model: str, prompt: str, cfg: BenchServeConfig) -> dict:
    body: dict[str, Any] = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


MAX_ERROR_BODY = 64 << 10
"""Bytes of an error answer read for its message: a server that streams an endless error body is cut off."""
MAX_SSE_LINE = 1 << 20
"""Longest SSE line accepted: a server that streams bytes without a newline fails the request, not the memory."""
ERROR_CHARS = 200
"""Longest error message kept per request (after redaction, so a cut never leaves half a secret)."""


class BadStream(Exception):
    """The server's answer is not a well-formed OpenAI stream; the message says how (kind: `bad_sse`)."""


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error", raw.decode(errors="replace"))
        msg = err.get("message", err) if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = raw.decode(errors="replace")
    return " ".join(str(msg).split())


async def _read_capped(r, limit: int) -> bytes:
    buf = bytearray()
    async for chunk in r.aiter_bytes():
        buf += chunk
        if len(buf) >= limit:
            break
    return bytes(buf[:limit])


async def _sse_lines(r):
    """The lines of a streamed body, each at most MAX_SSE_LINE bytes (else BadStream)."""
    buf = bytearray()
    async for chunk in r.aiter_bytes():
        buf += chunk
        while 0 <= (i := buf.find(b"\n")) <= MAX_SSE_LINE:
            yield bytes(buf[:i]).rstrip(b"\r").decode(errors="replace")
            del buf[:i + 1]
        if len(buf) > MAX_SSE_LINE:  # no newline within the limit: however the bytes arrived
            raise BadStream(f"an SSE line longer than {MAX_SSE_LINE} bytes")
    if buf:
        yield bytes(buf).decode(errors="replace")


def _chunk_text(obj: Any) -> tuple[int, Optional[int], bool]:
    """(content pieces, usage tokens or None, finished) of one parsed SSE chunk; BadStream if it is
    not shaped like an OpenAI chunk (a server's bug must fail the request, not the benchmark)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("choices") or [], list):
        raise BadStream(f"a chunk that is not an OpenAI chunk object: {json.dumps(obj)}")
    usage = obj.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
        raise BadStream(f"usage.completion_tokens is {tokens!r}, not a count")
    pieces, finished = 0, False
    for ch in obj.get("choices") or []:
        if not isinstance(ch, dict):
            raise BadStream(f"a choice that is not an object: {json.dumps(ch)}")
        delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
        text = ch.get("text") or delta.get("content") or delta.get("reasoning_content")
        pieces += bool(text)
        finished = finished or ch.get("finish_reason") is not None
    return pieces, tokens, finished


async def _stream(client, url: str, body: dict, t0: float) -> RequestResult:
    ttft = usage_tokens = None
    chunks, finished = 0, False
    max_chunks = 2 * int(body.get("max_tokens") or 0) + 16  # each content chunk holds >= 1 token; margin for odd servers
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raw = await _read_capped(r, MAX_ERROR_BODY)
            return RequestResult(False, time.perf_counter() - t0, error=f"http_{r.status_code}: {_error_message(raw)}")
        ctype = r.headers.get("content-type", "")
        if "text/event-stream" not in ctype:
            raw = await _read_capped(r, MAX_ERROR_BODY)
            return RequestResult(False, time.perf_counter() - t0, error=f"bad_response: HTTP 200 {ctype or 'without a content type'}, "
                                 f"not an SSE stream: {' '.join(raw.decode(errors='replace').split())}")
        try:
            async for line in _sse_lines(r):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    raise BadStream(f"a chunk that is not JSON: {data!r}") from None
                if isinstance(obj, dict) and obj.get("error"):
                    return RequestResult(False, time.perf_counter() - t0, ttft, chunks,
                                         error=f"stream_error: {_error_message(json.dumps(obj).encode())}")
                pieces, tokens, done = _chunk_text(obj)
                usage_tokens = tokens if tokens is not None else usage_tokens
                if pieces and ttft is None:
                    ttft = time.perf_counter() - t0
                chunks += pieces
                finished = finished or done
                if chunks > max_chunks:
                    return RequestResult(False, time.perf_counter() - t0, ttft, chunks,
                                         error=f"overlong: {chunks} content chunks for max_tokens={body.get('max_tokens')} "
                                         "and no end; the server ignores max_tokens")
        except BadStream as e:
            return RequestResult(False, time.perf_counter() - t0, ttft, chunks, error=f"bad_sse: {e}")
    latency = time.perf_counter() - t0
    if not finished:
        return RequestResult(False, latency, ttft, chunks, error="dropped: stream ended before [DONE]/finish_reason")
    tokens, source = (usage_tokens, "usage") if usage_tokens is not None else (chunks, "chunks")
    return RequestResult(True, latency, ttft, int(tokens), source)


async def one_request(client, url: str, body: dict, timeout_s: float, secrets: Sequence[str] = ()) -> RequestResult:
    """Send one streaming request; never raises, never outlives `timeout_s`. Its error, if any,
    is one line with every secret redacted (then cut to ERROR_CHARS): a server may echo the key."""
    import httpx  # why here: ~0.2 s to import, needed only when requests are sent

    t0 = time.perf_counter()
    try:
        res = await asyncio.wait_for(_stream(client, url, body, t0), timeout_s)
    except asyncio.TimeoutError:
        res = RequestResult(False, time.perf_counter() - t0, error=f"timeout: no complete answer within {timeout_s:g}s")
    except httpx.ConnectError as e:
        res = RequestResult(False, time.perf_counter() - t0, error=f"connect: {e}")
    except (httpx.HTTPError, OSError) as e:  # dropped connections surface as protocol/read errors
        res = RequestResult(False, time.perf_counter() - t0, error=f"dropped: {type(e).__name__}: {e}")
    except Exception as e:  # anything else a server's answer provokes fails this request, not its worker's others
        res = RequestResult(False, time.perf_counter() - t0, error=f"client_error: {type(e).__name__}: {e}")
    if res.error:
        res.error = redact(" ".join(res.error.split()), list(secrets))[:ERROR_CHARS]
    return res


# ----------------------------------------------------------------------------- one level


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[str, Optional[float]]:
    """Linear-interpolated percentiles (numpy's default) and the mean; None for no values."""
    out: dict[str, Optional[float]] = {}
    v = sorted(values)
    for q in qs:
        if not v:
            out[f"p{q}"] = None
            continue
        x = (len(v) - 1) * q / 100
        lo, hi = math.floor(x), math.ceil(x)
        out[f"p{q}"] = v[lo] + (v[hi] - v[lo]) * (x - lo)
    out["mean"] = sum(v) / len(v) if v else None
    return out


MAX_FAILURES_LISTED = 100
"""Failed requests listed one by one per level in results.json (all are counted by kind)."""


def summarize_level(concurrency: int, results: list[RequestResult], wall_s: float, not_sent: int,
                    spec: Optional[dict], failures: Optional[list[dict]] = None) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in results:
        if not r.ok:
            kind = (r.error or "unknown").split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
            examples.setdefault(kind, r.error or "")
    if not_sent:
        errors["not_sent"] = not_sent
    ms = lambda xs: {k: (None if v is None else round(v * 1000, 3)) for k, v in percentiles(xs).items()}  # noqa: E731
    tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency, "requests": len(results) + not_sent, "ok": len(ok),
        "failed": len(results) - len(ok) + not_sent, "errors": errors, "error_examples": examples,
        "failures": (failures or [])[:MAX_FAILURES_LISTED], "wall_s": round(wall_s, 4), "output_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_ms": ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "latency_ms": ms([r.latency_s for r in ok]),
        "tokens_from": sorted({r.tokens_from for r in ok}),
        "spec_decode": spec,
    }


async def scrape(client, url: Optional[str]) -> Optional[dict]:
    if not url:
        return None
    try:
        r = await asyncio.wait_for(client.get(url), 10)
        return parse_prometheus(r.text) if r.status_code == 200 else None
    except Exception:  # metrics are optional; the benchmark goes on without them
        return None


async def run_level(client, ep: Endpoint, api: str, prompts: list[str], concurrency: int, n_requests: int,
                    cfg: BenchServeConfig, bar=None, secrets: Sequence[str] = ()) -> dict:
    """One level: `n_requests` requests, at most `concurrency` in flight, within `level_timeout_s`.
    Each failed request gets one line on stderr and an entry in the level's `failures`."""
    url = ep.url.rstrip("/") + ("/chat/completions" if api == "chat" else "/completions")
    before = await scrape(client, ep.metrics_url)
    results: list[RequestResult] = []
    failures: list[dict] = []
    in_flight: dict[int, float] = {}

    def failed(i: int, error: str) -> None:
        failures.append({"request": i, "error": error})
        tqdm.write(f"{ep.label} c={concurrency} request {i}: {error}", file=sys.stderr)  # above the bar, if any
    next_i = 0
    t0 = time.perf_counter()
    deadline = t0 + cfg.level_timeout_s

    async def worker():
        nonlocal next_i
        while next_i < n_requests and time.perf_counter() < deadline:
            i, next_i = next_i, next_i + 1
            in_flight[i] = time.perf_counter()
            body = request_body(api, ep.model, prompts[i % len(prompts)], cfg)
            timeout = min(cfg.request_timeout_s, max(deadline - time.perf_counter(), 0.001))
            res = await one_request(client, url, body, timeout, secrets)
            results.append(res)
            del in_flight[i]
            if not res.ok:
                failed(i, res.error or "unknown")
            if bar is not None:
                bar.update(1)

    workers = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, n_requests))]
    done, pending = await asyncio.wait(workers, timeout=cfg.level_timeout_s + 5)
    for w in pending:  # only if a request ignored its own deadline; cancel and count it
        w.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    for i, started in list(in_flight.items()):
        results.append(RequestResult(False, time.perf_counter() - started, error="level_timeout: cancelled at the level deadline"))
        failed(i, results[-1].error)
    for i in range(next_i, n_requests):
        failed(i, f"not_sent: the level deadline ({cfg.level_timeout_s:g}s) passed first")
    wall = time.perf_counter() - t0
    after = await scrape(client, ep.metrics_url)
    return summarize_level(concurrency, results, wall, max(n_requests - next_i, 0), spec_window(before, after), failures)


# ----------------------------------------------------------------------------- the sweep


def _server_root(url: str) -> str:
    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}"


async def _discover_model(client, ep: Endpoint, timeout_s: float, secrets: Sequence[str]) -> str:
    try:
        r = await asyncio.wait_for(client.get(ep.url.rstrip("/") + "/models"), timeout_s)
        data = r.json().get("data") if r.status_code == 200 else None
        if data:
            return str(data[0]["id"])
        why = f"GET /models answered HTTP {r.status_code} without models"
    except Exception as e:
        why = redact(f"{type(e).__name__}: {' '.join(str(e).split())}", list(secrets))[:ERROR_CHARS]
    raise DraftsmithError(f"{ep.url}: cannot list the served models ({why}); start the server, check --url "
                          f"(it ends in /v1), or give the model name with --model")


def _resolve_metrics_url(given: Optional[str], url: str) -> Optional[str]:
    if given is not None:
        return None if given.lower() == "none" else given
    return _server_root(url) + "/metrics"


async def run_sweep(cfg: BenchServeConfig, prompts: list[str], api_key: Optional[str] = None) -> dict:
    """Discovery, warm-up and the levels. Bounded: per endpoint at most min(15, request_timeout_s)
    for /models, warmup_requests x request_timeout_s, and per level level_timeout_s + 5 s plus two
    /metrics scrapes of at most 10 s each."""
    import httpx  # why here: ~0.2 s to import, needed only when requests are sent

    eps = [Endpoint(cfg.label, cfg.url, cfg.model or "", _resolve_metrics_url(cfg.metrics_url, cfg.url))]
    if cfg.url_b:
        eps.append(Endpoint(cfg.label_b, cfg.url_b, cfg.model_b or "", _resolve_metrics_url(cfg.metrics_url_b, cfg.url_b)))
    levels = list(cfg.concurrency)
    n_per = {c: cfg.requests_per_level or max(16, 4 * c) for c in levels}
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=min(10.0, cfg.request_timeout_s))
    limits = httpx.Limits(max_connections=max(levels) + 8, max_keepalive_connections=max(levels) + 8)
    out: dict[str, Any] = {"levels": {ep.label: [] for ep in eps}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    secrets = secrets_of(cfg, api_key)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, headers=headers) as client:
        for ep in eps:
            ep.model = ep.model or await _discover_model(client, ep, min(15.0, cfg.request_timeout_s), secrets)
            warm = [await one_request(client, ep.url.rstrip("/") + ("/chat/completions" if cfg.api == "chat" else "/completions"),
                                      request_body(cfg.api, ep.model, prompts[i % len(prompts)], cfg), cfg.request_timeout_s,
                                      secrets)
                    for i in range(cfg.warmup_requests)]
            for i, r in enumerate(warm):
                if not r.ok:
                    log(f"{ep.label} warm-up request {i}: {r.error}")
            if warm and not any(r.ok for r in warm):
                raise DraftsmithError(f"{ep.url}: every warm-up request failed (first: {warm[0].error}); "
                                      "check that the server is up and serves this model and API (--api chat|completions)")
        out["endpoints"] = [asdict(ep) for ep in eps]
        total = sum(n_per.values()) * len(eps)
        with tqdm(total=total, unit="req", disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True) as bar:
            for li, c in enumerate(levels):
                for ep in (eps if li % 2 == 0 else eps[::-1]):  # A B, B A, ...: drift hits both alike
                    bar.set_description(f"{ep.label} c={c}")
                    out["levels"][ep.label].append(await run_level(client, ep, cfg.api, prompts, c, n_per[c], cfg, bar,
                                                                   secrets))
    for ep in eps:
        out["levels"][ep.label].sort(key=lambda lv: lv["concurrency"])
    out["failed"] = failure_summary(out["levels"])
    if len(eps) == 2:
        out["ab"] = ab_ratios(out["levels"][eps[0].label], out["levels"][eps[1].label])
    return out


def failure_summary(levels: dict[str, list[dict]]) -> dict:
    """Per endpoint: requests sent or due, how many failed, and the failures by kind."""
    out = {}
    for label, lvs in levels.items():
        kinds: dict[str, int] = {}
        for lv in lvs:
            for k, n in lv["errors"].items():
                kinds[k] = kinds.get(k, 0) + n
        out[label] = {"requests": sum(lv["requests"] for lv in lvs), "failed": sum(lv["failed"] for lv in lvs),
                      "by_kind": dict(sorted(kinds.items()))}
    return out


def _ratio(b: Optional[float], a: Optional[float]) -> Optional[float]:
    return b / a if a and b is not None else None


def ab_ratios(a_levels: list[dict], b_levels: list[dict]) -> list[dict]:
    """B / A per concurrency: throughput > 1 and TPOT < 1 mean B is faster."""
    rows = []
    for a, b in zip(a_levels, b_levels):
        rows.append({"concurrency": a["concurrency"],
                     "tokens_per_s_ratio": _ratio(b["tokens_per_s"], a["tokens_per_s"]),
                     "tpot_p50_ratio": _ratio(b["tpot_ms"]["p50"], a["tpot_ms"]["p50"]),
                     "ttft_p50_ratio": _ratio(b["ttft_ms"]["p50"], a["ttft_ms"]["p50"])})
    return rows


# ----------------------------------------------------------------------------- report


def _f(x: Optional[float], fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_table(res: dict) -> str:
    lines = []
    for label, levels in res["levels"].items():
        ep = next(e for e in res["endpoints"] if e["label"] == label)
        lines.append(f"{label}: {ep['url']} (model {ep['model']})")
        lines.append(f"{'conc':>5} {'ok/req':>9} {'tok/s':>9} {'req/s':>7} {'TTFT p50/p90/p99 ms':>23} "
                     f"{'TPOT p50/p90/p99 ms':>23} {'accept len':>10}  errors")
        for lv in levels:
            t, p = lv["ttft_ms"], lv["tpot_ms"]
            spec = lv["spec_decode"] or {}
            errs = ", ".join(f"{k}={v}" for k, v in lv["errors"].items()) or "-"
            lines.append(f"{lv['concurrency']:>5} {lv['ok']:>4}/{lv['requests']:<4} {_f(lv['tokens_per_s']):>9} "
                         f"{_f(lv['requests_per_s'], '{:.2f}'):>7} "
                         f"{_f(t['p50']):>7}/{_f(t['p90']):>7}/{_f(t['p99']):>7} "
                         f"{_f(p['p50'], '{:.2f}'):>7}/{_f(p['p90'], '{:.2f}'):>7}/{_f(p['p99'], '{:.2f}'):>7} "
                         f"{_f(spec.get('mean_acceptance_length'), '{:.2f}'):>10}  {errs}")
    if res.get("ab"):
        a, b = list(res["levels"])
        lines.append(f"A/B ({b} / {a}): throughput > 1 and TPOT < 1 mean {b} is faster")
        lines.append(f"{'conc':>5} {'tok/s ratio':>12} {'TPOT p50 ratio':>15} {'TTFT p50 ratio':>15}")
        for row in res["ab"]:
            lines.append(f"{row['concurrency']:>5} {_f(row['tokens_per_s_ratio'], '{:.3f}'):>12} "
                         f"{_f(row['tpot_p50_ratio'], '{:.3f}'):>15} {_f(row['ttft_p50_ratio'], '{:.3f}'):>15}")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib  # why here: ~0.7 s to import, and only this function draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, levels in res["levels"].items():
        c = [lv["concurrency"] for lv in levels]
        ax1.plot(c, [lv["tokens_per_s"] or 0 for lv in levels], "o-", label=label)
        line, = ax2.plot(c, [lv["tpot_ms"]["p50"] for lv in levels], "o-", label=f"{label} p50")
        ax2.plot(c, [lv["tpot_ms"]["p90"] for lv in levels], "--", color=line.get_color(), alpha=0.6, label=f"{label} p90")
    for ax, title, ylabel in ((ax1, "output throughput", "output tokens/s"), (ax2, "time per output token", "TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({lv["concurrency"] for lvs in res["levels"].values() for lv in lvs}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def ledger_summary(res: dict) -> dict:
    """Headline figures per endpoint: what plan calibrates on and status shows."""
    out = {}
    for label, levels in res["levels"].items():
        good = [lv for lv in levels if lv["ok"]]
        one = next((lv for lv in good if lv["concurrency"] == 1), None)
        peak = max(good, key=lambda lv: lv["tokens_per_s"] or 0, default=None)
        out[label] = {
            "single_stream_tpot_ms": one["tpot_ms"]["p50"] if one else None,
            "single_stream_tokens_per_s": one["tokens_per_s"] if one else None,
            "peak_tokens_per_s": peak["tokens_per_s"] if peak else None,
            "peak_concurrency": peak["concurrency"] if peak else None,
            "errors": sum(sum(lv["errors"].values()) for lv in levels),
            "errors_by_kind": (res.get("failed") or {}).get(label, {}).get("by_kind", {}),
            "levels": [{k: lv[k] for k in ("concurrency", "ok", "requests", "tokens_per_s", "requests_per_s")}
                       | {"tpot_p50_ms": lv["tpot_ms"]["p50"], "ttft_p50_ms": lv["ttft_ms"]["p50"],
                          "mean_acceptance_length": (lv["spec_decode"] or {}).get("mean_acceptance_length")}
                       for lv in levels],
        }
    return out


def request_temperature(cfg: BenchServeConfig) -> float:
    """--temperature, else the temperature of run_dir's evaluate stage, else 0."""
    if cfg.temperature is not None:
        return float(cfg.temperature)
    m = load_manifest(stage_dir(cfg.run_dir, "evaluate")) if cfg.run_dir else None
    t = ((m or {}).get("config") or {}).get("temperature")
    return float(t) if t is not None else 0.0


def run(cfg: BenchServeConfig) -> dict:
    """The whole benchmark: prompts, sweep, results.json, plot, ledger. Returns the results."""
    cfg = replace(cfg, temperature=request_temperature(cfg))
    levels = list(cfg.concurrency)
    if not levels or any(c < 1 for c in levels):
        raise DraftsmithError(f"--concurrency {levels}: not a list of positive levels; give positive integers, e.g. [1,2,4,8]")
    for name in ("url", "url_b", "metrics_url", "metrics_url_b"):
        u = getattr(cfg, name)
        if name.startswith("metrics") and (not u or u.lower() == "none"):
            continue
        try:
            parts = urlsplit(u) if u else None
            ok = parts is None or (parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0)
        except ValueError:  # e.g. a port that is not a number
            ok = False
        if not ok:
            raise DraftsmithError(f"--{name} {redact_url(u)!r}: not an http(s) URL with a host; give e.g. http://127.0.0.1:8000/v1")
    api_key = api_key_from_env(cfg.api_key_env)
    secrets = secrets_of(cfg, api_key)
    prompts = [p.turns[0] for p in load_prompts(cfg.prompts, cfg.max_prompts)]
    random.Random(cfg.seed).shuffle(prompts)
    out_dir = Path(cfg.out_dir or (Path(cfg.run_dir) / "bench_serve" if cfg.run_dir else "bench_serve"))
    t0 = time.time()
    try:
        res = asyncio.run(run_sweep(cfg, prompts, api_key))
    except DraftsmithError as e:  # its message names the URL, which may hold credentials
        raise DraftsmithError(redact(str(e), secrets)) from None
    res = {"config": asdict(cfg), "started_at": t0, "wall_s": round(time.time() - t0, 3),
           "versions": package_versions(), "num_prompts": len(prompts), **res}
    res = redact(to_jsonable(res), secrets)  # results.json, the printed table and the ledger never hold a credential
    atomic_write_json(out_dir / "results.json", res)
    plot(res, out_dir / "bench_serve.png")
    res["files"] = {"results": str(out_dir / "results.json"), "plot": str(out_dir / "bench_serve.png")}
    if cfg.run_dir:
        Ledger(cfg.run_dir).append("bench_serve", results=res["files"]["results"], api=cfg.api, prompts=cfg.prompts,
                                   max_tokens=cfg.max_tokens, endpoints=res["endpoints"],
                                   summary=ledger_summary(res), ab=res.get("ab"))
    return to_jsonable(res)


def parse_args(argv: list[str]) -> BenchServeConfig:
    p = cli_parser("draftsmith bench-serve", BenchServeConfig.__doc__, exit_on_error=False)
    p.add_argument("--config", action=ActionConfigFile, help="YAML with any of the options below")
    p.add_class_arguments(BenchServeConfig, None, fail_untyped=True)
    try:
        ns = p.parse_args(argv)
    except Exception as e:  # jsonargparse raises ArgumentError / SystemExit on bad flags
        if isinstance(e, SystemExit) and not e.code:
            raise
        raise DraftsmithError(f"command line: {' '.join(str(e).split())}; see `draftsmith bench-serve --help`") from None
    ns.pop("config", None)
    return BenchServeConfig(**{k: ns[k] for k in BenchServeConfig.__dataclass_fields__})


def main(argv: list[str]) -> int:
    """`draftsmith bench-serve [--url URL] [--url_b URL] [--concurrency [1,2,4]] ...`."""
    res = run(parse_args(argv))
    print(format_table(res))
    for label, f in res["failed"].items():
        if f["failed"]:
            kinds = ", ".join(f"{k}={n}" for k, n in f["by_kind"].items())
            print(f"{label}: {f['failed']} of {f['requests']} requests failed ({kinds}); one line each on stderr, all in results.json")
    print(f"wrote {res['files']['results']} and {res['files']['plot']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
