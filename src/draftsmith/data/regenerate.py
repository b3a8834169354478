"""Regenerate stage (optional, between prepare and capture): the target rewrites the assistant turns.

Drafters trained on the target's own answers accept more. For every conversation that prepare
kept (its shards' sample_index), turn by turn: the conversation so far, with earlier assistant
turns already replaced, is sent to the target, and its answer replaces the next assistant turn.
The answers come from a local batched `generate` (regenerate.server_url unset) or from any
OpenAI-compatible server (`vllm serve`, SGLang: POST {server_url}/chat/completions); nothing
else is contacted (redirects are refused).

Local decoding keeps the target's own token ids: an answer is spliced into its sample as the ids
the target produced (not its decoded text re-encoded, which can differ), and the next turn's
prompt is built from those ids, so each sample is exactly a sequence the target wrote
(template.render's answer_ids; counts.answers_reencoded and counts.prompt_mismatch say where that
could not hold). A server returns text, which is rendered as prepare renders it.

Writes RUN_DIR/regen/, the same format as data/ (capture then reads it):
    shard-NNNNN.safetensors   token ids + assistant-only loss masks of the regenerated conversations
    shard-NNNNN.jsonl         their messages (source_id, sample_index, messages)
    errors.jsonl              every conversation left out, with the reason (request failed after
                              retries, answer truncated at max_new_tokens, no loss token left)
    token_counts.safetensors  as prepare's, over the regenerated loss tokens
A chunk of prepare.samples_per_shard conversations is the unit of resume: a rerun continues after
the last chunk listed in the manifest. Conversations whose requests failed are sent again when a
request setting changes (retry_verdict): they go into chunks after the others, and a retry cut off
resumes too (what is still to send is what no shard holds and no other reason left out).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from ..fileio import atomic_save_safetensors, atomic_write_bytes, atomic_write_text, read_jsonl_whole, to_jsonable
from ..manifests import finish_manifest, load_manifest, new_manifest, require_complete, verify_shards, write_manifest
from ..messages import DraftsmithError, log
from ..rundir import rerun_command, stage_dir
from ..config import Recipe, RegenerateConfig
from ..speculate.cache import seeded_generator
from ..speculate.engine import plain_generate_batch
from ..speculate.fast import choose_mode, fast_target_or_none
from ..target.model import eos_token_ids, load_target, load_tokenizer
from .readers import ReadStats, read_conversations
from .shards import Sample, read_shard, shard_name, write_shard
from .template import prompt_ids, render

ERRORS_FILE = "errors.jsonl"
ERROR_KEYS = ("chunk", "sample_index", "reason")
"""Keys every errors.jsonl record has (read_errors checks them)."""
COUNTS_FILE = "token_counts.safetensors"
UNFINGERPRINTED = ("regenerate.concurrency", "regenerate.timeout_s", "regenerate.max_retries", "regenerate.retry_delay_s")
"""regenerate.* keys that never change an answer, left out of the stage's fingerprint
(stages.Stage.unfingerprinted): how many requests are in flight and how long and how often a
request is tried. Changing one leaves a complete regenerate stage complete, and a cut-off one
resumes, instead of regenerating every answer. They can change which requests failed, so the
failed requests of a complete output are sent again when one of them changed (retry_verdict): those
conversations only, into chunks of their own after the others."""


EXTRA_NAME = "the seed of sampled answers (seed)"


def skip_reason(recipe: Recipe) -> Optional[str]:
    """Why the stage does not run (stages.Stage.skipped): it is optional, off unless regenerate.enabled."""
    return None if recipe.regenerate.enabled else "regenerate.enabled is false; skipped (capture reads data/)"


def fingerprint_extra(recipe: Recipe) -> Optional[tuple[str, int]]:
    """Sampled answers are a function of the seed (stages.Stage.extra); greedy ones are not."""
    return ("seed", recipe.seed) if recipe.regenerate.temperature > 0 else None


def retry_verdict(manifest: dict, recipe: Recipe) -> tuple[str, str]:
    """(verdict, why) for a complete regenerate output whose fingerprint matches `recipe`: "done",
    or "continue" when requests failed in it and a request setting (UNFINGERPRINTED) changed since,
    the fix those failures name (a longer timeout, more retries): `run` then sends the failed
    conversations' requests again, and only those."""
    failed = int((manifest.get("counts") or {}).get("failed", 0))
    old = manifest.get("config") or {}
    names = [key.split(".")[1] for key in UNFINGERPRINTED]
    changed = [f"regenerate.{n} {old.get(n)} -> {getattr(recipe.regenerate, n)}" for n in names
               if old.get(n) != getattr(recipe.regenerate, n)]
    if failed and changed:
        return "continue", f"{failed} request(s) failed and {', '.join(changed)}: sending those again"
    return "done", ""


@dataclass
class Answer:
    text: Optional[str]
    error: Optional[str] = None
    """Why there is no usable answer: request failure or truncation."""
    ids: Optional[list[int]] = None
    """The answer's token ids as the target produced them (local decoding; a server gives text only)."""
    prompt: Optional[list[int]] = None
    """The prompt's token ids the target answered (local decoding)."""


# ----------------------------------------------------------------------------- generators


def bucket_rows(n: int, batch_size: int) -> int:
    """The rows a fast-path batch of n prompts runs as: n rounded up to a multiple of 64 (a power of
    two below 64), at most batch_size. A conversation's later turns are fewer than its first (most
    end or outgrow max_length), so padding each turn to batch_size ran most rows on copies."""
    size = -(-n // 64) * 64 if n > 64 else 1 << max(n - 1, 0).bit_length()
    return min(size, batch_size)


class LocalGenerator:
    """The target decodes left-padded batches, greedy at temperature 0: on the fast path
    (regenerate.fast; engine.plain_generate_batch on a FastTarget, what evaluate times as plain decoding) or through
    transformers' `generate`."""

    def __init__(self, recipe: Recipe):
        t = recipe.target
        self.target = load_target(t.path, t.device, t.dtype, t.trust_remote_code, with_tokenizer=True,
                                  device_map=t.device_map, experts_implementation=t.experts_implementation)
        self.tok = self.target.tokenizer
        self.cfg, self.seed = recipe.regenerate, recipe.seed
        self.generator: Optional[torch.Generator] = None  # sampled: this chunk's (start_chunk)
        self.eos = set(eos_token_ids(self.target))
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else min(self.eos)
        mode = choose_mode(self.cfg.fast, self.target, "regenerate.fast")
        # sized for every prompt that fits prepare.max_length: one cache per bucket size, its graphs captured once
        self.max_len = recipe.prepare.max_length + self.cfg.max_new_tokens
        self.fast = None if mode == "off" else fast_target_or_none(
            self.target, mode, self.cfg.fast, "regenerate.fast", "transformers generate",
            batch_size=self.cfg.batch_size, max_len=self.max_len)
        self.path = mode if self.fast is not None else "generate"
        self.start_chunk(0)

    def start_chunk(self, k: int) -> None:
        """Sampled answers of chunk k come from a generator seeded by (recipe seed, k): the same recipe
        writes the same answers, whether the run went through at once or resumed after a cut."""
        self.generator = seeded_generator(self.target.device, self.cfg.temperature, self.seed, k)

    def __call__(self, conversations: Sequence[list[dict]], answer_ids: Sequence[list]) -> list[Answer]:
        enc = [prompt_ids(self.tok, c, a) for c, a in zip(conversations, answer_ids)]
        out = []
        for i in range(0, len(enc), self.cfg.batch_size):
            out += self._batch(enc[i:i + self.cfg.batch_size])
        return out

    @torch.inference_mode()
    def _batch(self, enc: list[list[int]]) -> list[Answer]:
        if self.fast is not None:  # padded with copies to a bucket size (each new size means a new cache and graphs)
            size = bucket_rows(len(enc), self.cfg.batch_size)
            self.fast.ensure(size, self.max_len)  # the cache sized once per bucket, for every prompt that fits
            rows = enc + [enc[-1]] * (size - len(enc))
            gen = plain_generate_batch(self.target, rows, self.cfg.max_new_tokens, sorted(self.eos), self.cfg.temperature,
                                       self.generator, fast=self.fast)[:len(enc)]
            return self._answers(enc, gen)
        L = max(len(e) for e in enc)
        ids = torch.full((len(enc), L), self.pad, dtype=torch.long)
        mask = torch.zeros((len(enc), L), dtype=torch.long)
        for r, e in enumerate(enc):
            ids[r, L - len(e):], mask[r, L - len(e):] = torch.tensor(e), 1
        dev = self.target.device
        sample = self.cfg.temperature > 0
        kw = dict(do_sample=True, temperature=self.cfg.temperature) if sample else dict(do_sample=False)
        # generate draws from torch's default generators: seeded here from this chunk's, then restored
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            if sample:
                torch.manual_seed(int(torch.randint(1 << 62, (1,), generator=self.generator, device=self.generator.device)))
            gen = self.target.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                             max_new_tokens=self.cfg.max_new_tokens, eos_token_id=sorted(self.eos),
                                             pad_token_id=self.pad, **kw)[:, L:].cpu().tolist()
        return self._answers(enc, gen)

    def _answers(self, prompts: list[list[int]], gen: list[list[int]]) -> list[Answer]:
        answers = []
        for prompt, row in zip(prompts, gen):
            end = next((j for j, t in enumerate(row) if t in self.eos), None)
            if end is None and not self.cfg.keep_truncated:
                answers.append(Answer(None, f"truncated: no end of turn within max_new_tokens {self.cfg.max_new_tokens}"))
            else:
                ids = row[:end]
                answers.append(Answer(self.tok.decode(ids, skip_special_tokens=True), ids=ids, prompt=prompt))
        return answers


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused (talks only to server_url)", headers, fp)


def request_seed(seed: int, chunk: int, messages: list[dict]) -> int:
    """The OpenAI API's per-request `seed` of a sampled answer: a function of (recipe seed, chunk, the
    messages answered), so a rerun or a resumed run asks for the same draws whatever order the
    requests go in (vLLM and SGLang seed the request's sampler with it; an answer is then as
    reproducible as the server's batching keeps its logits)."""
    key = json.dumps([seed, chunk, messages], sort_keys=True, ensure_ascii=False).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") >> 1  # 0 .. 2**31 - 1: any server's int


class ServerGenerator:
    """POST {server_url}/chat/completions, `concurrency` requests at a time, with retries."""

    def __init__(self, cfg: RegenerateConfig, seed: int = 0):
        self.cfg, self.seed, self.chunk = cfg, seed, 0
        self.url = cfg.server_url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise DraftsmithError(f"regenerate.server_url {cfg.server_url!r}: not an http(s) URL; give the server's "
                                  "OpenAI-compatible base, e.g. http://127.0.0.1:8000/v1")
        self.opener = urllib.request.build_opener(_NoRedirect, urllib.request.ProxyHandler({}))
        self.model = cfg.server_model or self._first_model()

    def _request(self, path: str, body: Optional[dict] = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
        with self.opener.open(req, timeout=self.cfg.timeout_s) as r:
            return json.loads(r.read().decode("utf-8"))

    def _first_model(self) -> str:
        try:
            models = self._request("/models")["data"]
            return str(models[0]["id"])
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise DraftsmithError(f"regenerate.server_url {self.url}: GET /models failed ({type(e).__name__}: {e}); start the "
                                  "server (vllm serve / sglang) or set regenerate.server_model") from None

    def _one(self, messages: list[dict]) -> Answer:
        body = {"model": self.model, "messages": messages, "max_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature}
        if self.cfg.temperature > 0:
            body["seed"] = request_seed(self.seed, self.chunk, messages)
        error = "no attempt"
        for attempt in range(self.cfg.max_retries + 1):
            try:
                choice = self._request("/chat/completions", body)["choices"][0]
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {e.read()[:200].decode('utf-8', 'replace') if e.fp else e.reason}"
                if 400 <= e.code < 500 and e.code != 429:
                    break  # the request itself is wrong: retrying cannot help
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
                error = f"{type(e).__name__}: {e}"
            else:
                content = (choice.get("message") or {}).get("content")
                if choice.get("finish_reason") == "length" and not self.cfg.keep_truncated:
                    return Answer(None, f"truncated: finish_reason length at max_new_tokens {self.cfg.max_new_tokens}")
                if not isinstance(content, str):
                    return Answer(None, f"no message content in the response (finish_reason {choice.get('finish_reason')})")
                return Answer(content)
            if attempt < self.cfg.max_retries:
                time.sleep(min(2.0 ** attempt, 30.0) * self.cfg.retry_delay_s)
        return Answer(None, f"request failed after {attempt + 1} attempt(s): {error}")

    def start_chunk(self, k: int) -> None:
        """Sampled requests of chunk k carry a seed (request_seed)."""
        self.chunk = k

    def __call__(self, conversations: Sequence[list[dict]], answer_ids: Sequence[list] = ()) -> list[Answer]:
        """Text answers (a chat server re-encodes earlier answers itself; `answer_ids` are not sent)."""
        with ThreadPoolExecutor(max_workers=max(1, self.cfg.concurrency)) as pool:
            return list(pool.map(self._one, [list(c) for c in conversations]))


# ----------------------------------------------------------------------------- the stage


@dataclass
class Regenerated:
    messages: list[dict]
    """The conversation with its assistant turns replaced (text)."""
    answers: list[Answer]
    """The answer of each assistant turn kept (ids and prompt ids on local decoding)."""
    error: Optional[str] = None
    """Why the conversation was left out."""


def regenerate_conversations(generate, conversations: Sequence[list[dict]],
                             fits: Optional[Callable[[list[dict], list], bool]] = None,
                             max_turns: Optional[int] = None) -> list[Regenerated]:
    """Each conversation with its assistant turns replaced, round by round (turn r of every
    conversation in one call of `generate(messages, answer_ids)`, where answer_ids are the earlier
    answers' token ids), or with the reason it failed. `fits(messages, answer_ids)` says whether an
    answer to these messages still starts inside prepare.max_length; a conversation ends before its
    first turn that does not (training would cut it off anyway), and after its `max_turns`-th answer."""
    msgs = [[dict(m) for m in c] for c in conversations]
    turns = [[j for j, m in enumerate(c) if m["role"] == "assistant"] for c in msgs]
    if max_turns is not None:
        msgs = [m[:t[max_turns - 1] + 1] if len(t) > max_turns else m for m, t in zip(msgs, turns)]
        turns = [t[:max_turns] for t in turns]
    answers: list[list[Answer]] = [[] for _ in msgs]
    failed: list[Optional[str]] = [None] * len(msgs)
    for r in range(max((len(t) for t in turns), default=0)):
        todo = [i for i in range(len(msgs)) if failed[i] is None and r < len(turns[i])]
        if fits is not None and r > 0:  # end a conversation before a turn training would cut off
            for i in todo:
                if not fits(msgs[i][:turns[i][r]], [a.ids for a in answers[i]]):
                    msgs[i], turns[i] = msgs[i][:turns[i][r]], turns[i][:r]
            todo = [i for i in todo if r < len(turns[i])]
        if not todo:
            break
        got = generate([msgs[i][:turns[i][r]] for i in todo], [[a.ids for a in answers[i]] for i in todo])
        for i, a in zip(todo, got):
            if a.error is not None:
                failed[i] = f"assistant turn {r + 1}: {a.error}"
            else:
                msgs[i][turns[i][r]] = {"role": "assistant", "content": a.text}
                answers[i].append(a)
    return [Regenerated(m, a, f) for m, a, f in zip(msgs, answers, failed)]


def error_kind(e: dict) -> str:
    """failed (a request), truncated (at max_new_tokens) or no_loss_tokens, of an errors.jsonl record
    (older records have no `kind`: read from the reason)."""
    reason = e.get("reason", "")
    return e.get("kind") or ("truncated" if "truncated" in reason else "no_loss_tokens" if "loss tokens" in reason else "failed")


def kept_indices(data_dir: Path, data_m: dict) -> list[int]:
    return [s.sample_index for p in verify_shards(data_dir, data_m) for s in read_shard(p, with_hidden=False)]


def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    cfg, pcfg = recipe.regenerate, recipe.prepare
    data_dir, out = stage_dir(run_dir, "prepare"), stage_dir(run_dir, "regenerate")
    data_m = require_complete(data_dir, "prepare")
    indices = kept_indices(data_dir, data_m)
    path, fmt = Path(data_m["source"]["path"]), data_m["source"]["format"]
    chunks = [indices[i:i + pcfg.samples_per_shard] for i in range(0, len(indices), pcfg.samples_per_shard)]

    m = load_manifest(out)
    retry = m is not None and m["status"] == "complete" and m["fingerprint"] == fp  # only retry_verdict reruns one
    if not retry and (m is None or m["status"] != "running" or m["fingerprint"] != fp):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        m = new_manifest("regenerate", fp, cfg, {"prepare": data_m["fingerprint"]})
        m.update(source=data_m["source"], tokenizer=data_m.get("tokenizer"),
                 backend=cfg.server_url or "local generate")
        m["counts"] = {"conversations": 0, "kept": 0, "failed": 0, "truncated": 0, "no_loss_tokens": 0, "tokens": 0,
                       "loss_tokens": 0, "answers_reencoded": 0, "prompt_mismatch": 0}
        atomic_write_text(out / ERRORS_FILE, "")
        write_manifest(out, m)
    for key in ("answers_reencoded", "prompt_mismatch"):  # a run resumed from an older manifest
        m["counts"].setdefault(key, 0)
    m["config"] = to_jsonable(cfg)  # the request settings this run uses (a retry's may differ from the first run's)
    # errors of chunks the manifest lists; lines of a chunk that was cut off are written again
    done_chunks = len(m["shards"])
    errors = [e for e in read_jsonl_whole(out / ERRORS_FILE, ERROR_KEYS, f"redo the stage with {rerun_command('regenerate', run_dir)}")
              if isinstance(e["chunk"], int) and e["chunk"] < done_chunks]

    tok = load_tokenizer(recipe.target.path, recipe.target.trust_remote_code)
    generate = ServerGenerator(cfg, recipe.seed) if cfg.server_url else LocalGenerator(recipe)
    if not cfg.server_url:
        m["decoding_path"] = generate.path  # generate, or the fast path's mode (static, graphs, compile)
    via = cfg.server_url or f"local decoding ({generate.path})"
    fits = lambda messages, answer_ids: len(prompt_ids(tok, messages, answer_ids)) < pcfg.max_length  # noqa: E731
    counts = m["counts"]
    stats = ReadStats()
    t0 = time.time()

    def conversations(ids: list[int]):
        want = set(ids)
        convs = [c for c in read_conversations(path, fmt, stats, pcfg.role_map, pcfg.on_unknown_role,
                                               start=ids[0], stop=ids[-1] + 1) if c.index in want]
        if [c.index for c in convs] != ids:
            raise DraftsmithError(f"{path}: records {ids[0]}..{ids[-1]} no longer match what prepare read; "
                                  f"the source changed, rerun {rerun_command('prepare', run_dir)}")
        return convs

    def chunk(k: int, convs, retried: bool) -> None:
        """Regenerate `convs` into chunk k: its shard, its errors, the manifest that lists it (the last write)."""
        nonlocal t0
        generate.start_chunk(k)
        results = regenerate_conversations(generate, [c.messages for c in convs], fits, recipe.regenerate.max_turns)
        samples, texts = [], []
        for conv, res in zip(convs, results):
            reason = res.error
            kind = None if reason is None else "truncated" if "truncated" in reason else "failed"
            if reason is None:
                # the target's own answer tokens (local decoding), not a re-encoding of their text
                r = render(tok, res.messages, pcfg.max_length, [a.ids for a in res.answers])
                counts["answers_reencoded"] += r.unspliced
                # a template whose rendering of a prefix differs from its generation prompt (counted, not hidden)
                counts["prompt_mismatch"] += sum(a.prompt is not None and at < pcfg.max_length and r.input_ids[:at] != a.prompt[:at]
                                                 for a, at in zip(res.answers, r.answer_starts))
                if sum(r.loss_mask) < pcfg.min_loss_tokens:
                    kind = "no_loss_tokens"
                    reason = f"fewer than {pcfg.min_loss_tokens} loss tokens after rendering (max_length {pcfg.max_length})"
            if reason is not None:
                counts[kind] += 1
                errors.append({"chunk": k, "sample_index": conv.index, "source_id": conv.source_id, "reason": reason,
                               "kind": kind})
                continue
            samples.append(Sample(torch.tensor(r.input_ids, dtype=torch.int64), torch.tensor(r.loss_mask, dtype=torch.bool),
                                  conv.index, source_id=conv.source_id))
            texts.append(json.dumps({"source_id": conv.source_id, "sample_index": conv.index, "messages": res.messages}))
            counts["tokens"] += len(r.input_ids)
            counts["loss_tokens"] += sum(r.loss_mask)
        if retried:  # counted as failed before; counted above as what they are now
            counts["failed"] -= len(convs)
        else:
            counts["conversations"] += len(convs)
        counts["kept"] += len(samples)
        # errors first: a chunk is done only once the manifest lists it, and its errors are on disk by then
        atomic_write_text(out / ERRORS_FILE, "".join(json.dumps(e) + "\n" for e in errors))
        name = shard_name(k)
        atomic_write_bytes(out / name.replace(".safetensors", ".jsonl"), "".join(t + "\n" for t in texts).encode())
        entry = write_shard(out / name, samples, metadata={"stage": "regenerate"})
        m["shards"].append(entry)
        now = time.time()  # per chunk: a run cut off (and resumed) keeps the time its finished chunks took
        m["timings"]["regenerate_s"] = round(m["timings"].get("regenerate_s", 0) + now - t0, 3)
        t0 = now
        write_manifest(out, m)

    log(f"[regenerate] {len(indices):,} conversations in {len(chunks)} chunk(s) through {via}; "
        f"{min(done_chunks, len(chunks))} chunk(s) done before")
    for k in tqdm(range(done_chunks, len(chunks)), desc="regenerate", unit="chunk", file=sys.stderr, disable=None):
        chunk(k, conversations(chunks[k]), retried=False)
    if retry or m.get("retrying"):
        m["status"], m["retrying"] = "running", True  # written once the generator is up (a server that is down
        write_manifest(out, m)                        # leaves the complete output complete); a cut-off retry resumes
        # what is still to send: no shard holds it and no reason but a failed request left it out (robust to a
        # retry cut off between its writes); the error lines of what a listed shard now holds go
        held = {s.sample_index for p in verify_shards(out, m) for s in read_shard(p, with_hidden=False)}
        settled = held | {e["sample_index"] for e in errors if error_kind(e) != "failed"}
        todo = [i for i in indices if i not in settled]
        errors[:] = [e for e in errors if not (error_kind(e) == "failed" and e["sample_index"] in held)]
        counts["failed"] = len(todo)
        log(f"[regenerate] sending the {len(todo):,} failed conversation(s) again through {via}")
        for j in range(0, len(todo), pcfg.samples_per_shard):
            part = todo[j:j + pcfg.samples_per_shard]
            errors[:] = [e for e in errors if e["sample_index"] not in set(part)]  # chunk() writes theirs anew
            chunk(len(m["shards"]), conversations(part), retried=True)
        del m["retrying"]

    counts_vec = torch.zeros(len(tok), dtype=torch.int64)
    for p in verify_shards(out, m):
        for s in read_shard(p, with_hidden=False):
            counts_vec += torch.bincount(s.input_ids[s.loss_mask], minlength=len(tok))[:len(tok)]
    sha = atomic_save_safetensors(out / COUNTS_FILE, {"counts": counts_vec}, metadata={"stage": "regenerate"})
    m["files"] = [{"file": COUNTS_FILE, "sha256": sha}, {"file": ERRORS_FILE}]
    if m["timings"].get("regenerate_s", 0) > 0:  # assistant tokens (the generated answers) per second, all chunks
        m["metrics"]["loss_tokens_per_s"] = round(counts["loss_tokens"] / m["timings"]["regenerate_s"], 1)
    left_out = counts["conversations"] - counts["kept"]
    log(f"[regenerate] kept {counts['kept']:,} of {counts['conversations']:,} conversations; {left_out:,} left out "
        f"({counts['truncated']} truncated, {counts['failed']} failed, {counts['no_loss_tokens']} without loss tokens), "
        f"reasons in {out / ERRORS_FILE}")
    if counts["kept"] == 0:
        raise DraftsmithError(f"{out / ERRORS_FILE}: no conversation was regenerated ({left_out} left out); "
                              "read the reasons there (server down? raise regenerate.max_new_tokens?)")
    return finish_manifest(out, m)


def read_errors(run_dir: Path) -> list[dict]:
    """The errors file of a run's regenerate stage, as records."""
    return read_jsonl_whole(stage_dir(run_dir, "regenerate") / ERRORS_FILE, ERROR_KEYS,
                            f"redo the stage with {rerun_command('regenerate', run_dir)}")

