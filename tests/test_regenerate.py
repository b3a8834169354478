"""regenerate: the target rewrites the assistant turns through an OpenAI-compatible server (a tiny
one started here on 127.0.0.1) or local generate; failures go to errors.jsonl; reruns resume."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml

from draftsmith.manifests import load_manifest, write_manifest
from draftsmith.messages import DraftsmithError
from draftsmith.rundir import Ledger
from draftsmith.cli import main, parse_recipe
from draftsmith.data import regenerate
from draftsmith.data.regenerate import read_errors
from draftsmith.data.shards import read_shard
from draftsmith.pipeline import run_stage, stage_fingerprint

TARGET = Path(__file__).resolve().parents[1] / "assets" / "tiny-llama-sharegpt"  # trained: it ends its answers
PROMPTS = ["Say hello.", "Hi", "Write a poem.", "FAIL please", "Hello!", "Tell me a joke."]
MAX_NEW = 32  # the tiny model ends its greetings in time, not its poems and jokes


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class TinyServer:
    """A minimal OpenAI-compatible chat server over a local model (greedy), on 127.0.0.1.
    A conversation whose last user turn contains FAIL gets HTTP 500 (while `failing`)."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.lock = threading.Lock()
        self.paths: list[str] = []
        self.chat_requests = 0
        self.seeds: list = []  # each chat request's `seed` (None: none sent)
        server = self
        self.failing = True

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                server.paths.append(self.path)
                self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self):
                server.paths.append(self.path)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions" or body.get("model") != "tiny":
                    return self._send(404, {"error": "not found"})
                with server.lock:
                    server.chat_requests += 1
                    server.seeds.append(body.get("seed"))
                if server.failing and "FAIL" in body["messages"][-1]["content"]:
                    return self._send(500, {"error": "injected failure"})
                text, finish = server.generate(body["messages"], body["max_tokens"])
                self._send(200, {"object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @torch.inference_mode()
    def generate(self, messages: list[dict], max_tokens: int) -> tuple[str, str]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with self.lock:
            out = self.model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)[0, ids["input_ids"].shape[1]:]
        eos = self.tok.eos_token_id
        ended = bool((out == eos).any())
        row = out[:int((out == eos).nonzero()[0, 0])] if ended else out
        return self.tok.decode(row, skip_special_tokens=True), "stop" if ended else "length"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server():
    s = TinyServer(TARGET)
    yield s
    s.close()


def _recipe(tmp: Path, **regen) -> list[str]:
    convs = [[{"from": "human", "value": p}, {"from": "gpt", "value": "An old answer."}] for p in PROMPTS]
    convs.append([{"from": "human", "value": "Say hello."}, {"from": "gpt", "value": "Hi."},
                  {"from": "human", "value": "Thank you!"}, {"from": "gpt", "value": "Bye."}])  # two turns
    (tmp / "convs.json").write_text(json.dumps([{"id": f"c{i}", "conversations": c} for i, c in enumerate(convs)]))
    recipe = {"run_dir": str(tmp / "run"), "target": {"path": str(TARGET), "device": "cpu", "dtype": "float32"},
              "prepare": {"source": str(tmp / "convs.json"), "max_length": 256, "samples_per_shard": 3},
              "regenerate": {"enabled": True, "max_new_tokens": MAX_NEW, "retry_delay_s": 0.0, "max_retries": 1, **regen},
              "capture": {"batch_tokens": 512, "storage_dtype": "bfloat16"}}
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return [str(tmp / "recipe.yaml")]


def _conversations(run_dir: Path) -> dict[int, list[dict]]:
    out = {}
    for p in sorted((run_dir / "regen").glob("shard-*.jsonl")):
        for line in p.read_text().splitlines():
            rec = json.loads(line)
            out[rec["sample_index"]] = rec["messages"]
    return out


def test_server_regenerate_then_capture(tmp_path, server):
    args = _recipe(tmp_path, server_url=server.url)
    for stage in ("prepare", "regenerate", "capture"):
        assert main([stage, *args]) == 0
    run_dir = tmp_path / "run"
    m = load_manifest(run_dir / "regen")
    assert m["status"] == "complete" and len(m["shards"]) == 3
    c = m["counts"]
    errors = read_errors(run_dir)
    # nothing is dropped silently: every conversation is in a shard or in errors.jsonl
    assert c["conversations"] == 7 and c["kept"] + len(errors) == 7 and c["kept"] >= 2
    by_index = {e["sample_index"]: e["reason"] for e in errors}
    assert "request failed after 2 attempt(s): HTTP 500" in by_index[3]  # FAIL: retried once, then recorded
    assert c["failed"] == 1 and c["truncated"] == len(errors) - 1 and c["truncated"] >= 1
    assert all("truncated" in r for i, r in by_index.items() if i != 3)
    convs = _conversations(run_dir)
    assert set(convs) | set(by_index) == set(range(7)) and not set(convs) & set(by_index)
    for i, msgs in convs.items():  # the answers are the server's, the user turns the source's
        for msg in msgs:
            assert msg["content"] not in ("An old answer.", "Hi.", "Bye.")
        assert server.generate(msgs[:-1], MAX_NEW) == (msgs[1]["content"], "stop")
    # regen shards hold the regenerated tokens, and capture read them
    tok_samples = [s for p in sorted((run_dir / "regen").glob("shard-*.safetensors")) for s in read_shard(p, False)]
    cap = load_manifest(run_dir / "capture")
    assert cap["source"] == "regenerate" and cap["counts"]["samples"] == len(tok_samples) == c["kept"]
    cap_samples = [s for p in sorted((run_dir / "capture").glob("shard-*.safetensors")) for s in read_shard(p)]
    assert [s.input_ids.tolist() for s in cap_samples] == [s.input_ids.tolist() for s in tok_samples]
    # only the configured server was contacted, only its OpenAI paths
    assert all(p.startswith("/v1/") for p in server.paths)

    # a rerun after a stop continues where it stopped: drop the last chunk from the manifest
    before = {p.name: p.read_bytes() for p in (run_dir / "regen").glob("shard-*")}
    errors_before = (run_dir / "regen" / "errors.jsonl").read_text()
    m["status"] = "running"
    m["shards"] = m["shards"][:2]
    write_manifest(run_dir / "regen", m)
    (run_dir / "regen" / "shard-00002.safetensors").unlink()
    n = server.chat_requests
    assert main(["regenerate", *args]) == 0
    assert server.chat_requests - n <= 2  # only the last chunk's conversation(s) again
    assert {p.name: p.read_bytes() for p in (run_dir / "regen").glob("shard-*")} == before
    assert (run_dir / "regen" / "errors.jsonl").read_text() == errors_before


def test_request_settings_do_not_regenerate_a_complete_stage(tmp_path, server):
    """concurrency, timeout_s, max_retries and retry_delay_s never change an answer: changing them
    leaves a complete stage complete (no request sent) instead of regenerating every answer."""
    args = [*_recipe(tmp_path, server_url=server.url), "--prepare.max_samples", "3"]  # no FAIL prompt: nothing fails
    assert main(["prepare", *args]) == 0 and main(["regenerate", *args]) == 0
    run_dir = tmp_path / "run"
    before = load_manifest(run_dir / "regen")
    assert before["status"] == "complete" and before["counts"]["failed"] == 0
    n = server.chat_requests
    changed = ["--regenerate.concurrency", "2", "--regenerate.timeout_s", "30", "--regenerate.max_retries", "5",
               "--regenerate.retry_delay_s", "0.5"]
    assert main(["regenerate", *args, *changed]) == 0
    assert server.chat_requests == n
    assert Ledger(run_dir).read()[-1]["event"] == "stage_skipped"
    assert load_manifest(run_dir / "regen") == before
    assert main(["regenerate", *args, "--regenerate.max_new_tokens", str(MAX_NEW + 1)]) == 0  # an answer setting does
    assert server.chat_requests > n


def test_request_settings_regenerate_a_stage_whose_requests_failed(tmp_path, server):
    """A complete stage with failed requests is regenerated when a request setting changed (the fix
    those failures call for), and skipped when none did."""
    args = _recipe(tmp_path, server_url=server.url)
    assert main(["prepare", *args]) == 0 and main(["regenerate", *args]) == 0
    run_dir = tmp_path / "run"
    assert load_manifest(run_dir / "regen")["counts"]["failed"] == 1
    n = server.chat_requests
    assert main(["regenerate", *args]) == 0 and server.chat_requests == n
    assert main(["regenerate", *args, "--regenerate.max_retries", "2"]) == 0
    assert server.chat_requests > n
    assert load_manifest(run_dir / "regen")["config"]["max_retries"] == 2


def test_failed_requests_are_sent_again_and_only_they(tmp_path, server, monkeypatch):
    """A complete stage whose request failed, rerun with a request setting changed (the fix the failure
    calls for): only the failed conversation is sent again, into a chunk after the others (their shards
    stay byte for byte), and it leaves errors.jsonl as what it is now. A retry cut off after its shard
    but before the manifest listed it sends that conversation again on the next run."""
    monkeypatch.setattr(server, "failing", True)
    args = _recipe(tmp_path, server_url=server.url)
    run_dir, regen = tmp_path / "run", tmp_path / "run" / "regen"
    assert main(["prepare", *args]) == 0 and main(["regenerate", *args]) == 0
    first = load_manifest(regen)["counts"]
    assert first["failed"] == 1 and len(load_manifest(regen)["shards"]) == 3
    before = {p.name: p.read_bytes() for p in regen.glob("shard-*")}

    def down(self):  # the server does not answer: the retry stops before it touches the complete output
        raise DraftsmithError(f"regenerate.server_url {self.url}: GET /models failed (down)")

    complete = load_manifest(regen)
    with monkeypatch.context() as mp:
        mp.setattr(regenerate.ServerGenerator, "_first_model", down)
        assert main(["regenerate", *args, "--regenerate.max_retries", "2"]) != 0
    assert load_manifest(regen) == complete

    server.failing = False
    n = server.chat_requests
    assert main(["regenerate", *args, "--regenerate.max_retries", "2"]) == 0
    assert server.chat_requests - n == 1  # the failed conversation's one turn, nothing else
    m = load_manifest(regen)
    assert m["status"] == "complete" and "retrying" not in m and len(m["shards"]) == 4 and m["config"]["max_retries"] == 2
    assert all((regen / name).read_bytes() == b for name, b in before.items())
    c, errors, convs = m["counts"], read_errors(run_dir), _conversations(run_dir)
    assert c["failed"] == 0 and c["conversations"] == 7 and c["kept"] == len(convs)
    assert c["kept"] + c["truncated"] + c["no_loss_tokens"] == 7 and len(errors) == c["truncated"] + c["no_loss_tokens"]
    assert set(convs) | {e["sample_index"] for e in errors} == set(range(7)) and not set(convs) & {e["sample_index"] for e in errors}
    assert 3 in convs or any(e["sample_index"] == 3 and e["chunk"] == 3 and e["kind"] == "truncated" for e in errors)
    after = (m, regen.joinpath("errors.jsonl").read_text(), {p.name: p.read_bytes() for p in regen.glob("shard-*")})

    n = server.chat_requests  # nothing failed now: another setting change sends nothing
    assert main(["regenerate", *args, "--regenerate.max_retries", "3"]) == 0 and server.chat_requests == n

    # cut off after the retried chunk's errors and shard were written, before the manifest listed it
    cut = {**after[0], "status": "running", "retrying": True, "shards": after[0]["shards"][:3], "counts": first}
    write_manifest(regen, cut)
    assert main(["regenerate", *args, "--regenerate.max_retries", "3"]) == 0
    assert server.chat_requests - n == 1
    m = load_manifest(regen)
    assert m["status"] == "complete" and m["counts"] == after[0]["counts"] and len(m["shards"]) == 4
    assert regen.joinpath("errors.jsonl").read_text() == after[1]
    assert {p.name: p.read_bytes() for p in regen.glob("shard-*")} == after[2]
    assert main(["capture", *args, "--regenerate.max_retries", "3"]) == 0
    assert load_manifest(run_dir / "capture")["counts"]["samples"] == c["kept"]


def test_local_generate(tmp_path):
    args = _recipe(tmp_path, batch_size=4)
    recipe = parse_recipe(args)[0]
    run_stage("prepare", recipe)
    m = run_stage("regenerate", recipe)
    assert m["backend"] == "local generate"
    errors = read_errors(tmp_path / "run")
    assert m["counts"]["kept"] + len(errors) == 7 and m["counts"]["kept"] >= 2
    convs = _conversations(tmp_path / "run")
    assert "Hello" in convs[0][1]["content"]  # the trained tiny model answers "Say hello." with a greeting


def test_disabled_changes_nothing(tmp_path):
    args = _recipe(tmp_path, enabled=False)
    recipe = parse_recipe(args)[0]
    run_stage("prepare", recipe)
    assert run_stage("regenerate", recipe) == {}
    assert not (tmp_path / "run" / "regen").exists()
    assert [e["stage"] for e in Ledger(tmp_path / "run").read()] == ["prepare", "prepare"]


def test_unreachable_server_fails_every_request(tmp_path):
    args = _recipe(tmp_path, server_url="http://127.0.0.1:9/v1", server_model="x", max_retries=0, timeout_s=2.0)
    assert main(["prepare", *args]) == 0
    assert main(["regenerate", *args]) == 2  # nothing kept: a one-line error naming errors.jsonl
    errors = read_errors(tmp_path / "run")
    assert len(errors) == 7 and all("request failed after 1 attempt(s)" in e["reason"] for e in errors)


def test_turns_past_max_length_are_not_generated():
    """A turn whose prompt already fills prepare.max_length is cut off in training anyway: the
    conversation ends before it, and it costs no generate call."""
    from draftsmith.data.regenerate import Answer, regenerate_conversations

    calls = []

    def generate(prompts, answer_ids):
        calls.append(len(prompts))
        assert [len(a) for a in answer_ids] == [sum(m["role"] == "assistant" for m in p) for p in prompts]
        return [Answer(text="x" * 10, ids=[7] * 10) for _ in prompts]

    long = [m for i in range(5) for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "old"})]
    short = long[:4]
    fits = lambda msgs, ids: sum(len(m["content"]) for m in msgs) < 25  # noqa: E731  (2 answers of 10 fit, a 3rd does not)
    a, b = regenerate_conversations(generate, [long, short], fits)
    assert a.error is b.error is None and calls == [2, 2]  # round 3 of `long` is skipped: its prompt no longer fits
    assert [m["content"] for m in a.messages] == ["q0", "x" * 10, "q1", "x" * 10, "q2"]  # ends before the cut turn
    assert [m["content"] for m in b.messages] == ["q0", "x" * 10, "q1", "x" * 10]
    assert [x.ids for x in a.answers] == [[7] * 10] * 2
    everything = regenerate_conversations(generate, [long])  # no limit: every turn
    assert calls[2:] == [1] * 5 and everything[0].messages[-1]["content"] == "x" * 10


def test_max_turns_ends_each_conversation_after_its_last_regenerated_answer():
    """regenerate.max_turns 1: one generate call per conversation, the conversation cut after its first
    answer (no later user turn left without an answer, no human answer kept beside the target's)."""
    from draftsmith.data.regenerate import Answer, regenerate_conversations

    calls = []

    def generate(prompts, answer_ids):
        calls.append(len(prompts))
        return [Answer(text="new", ids=[7]) for _ in prompts]

    conv = [m for i in range(3) for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "old"})]
    one = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}]
    a, b = regenerate_conversations(generate, [conv, one], max_turns=1)
    assert calls == [2]
    assert [m["content"] for m in a.messages] == ["q0", "new"] and [m["content"] for m in b.messages] == ["s", "q", "new"]
    two = regenerate_conversations(generate, [conv], max_turns=2)[0]
    assert [m["content"] for m in two.messages] == ["q0", "new", "q1", "new"]


def test_regenerated_samples_hold_the_targets_own_tokens(tmp_path):
    """Local decoding keeps the token ids the target produced: every content token of a regenerated
    sample is the target's greedy choice given the sample's tokens before it (decode -> encode is not
    the identity: a random model's answers re-encode differently almost every time), and each turn's
    prefix in the sample is the very prompt the target answered (two-turn conversation included)."""
    from draftsmith.testing import make_model_dir

    target = make_model_dir(tmp_path / "target", seed=3)
    args = _recipe(tmp_path, batch_size=4, keep_truncated=True, max_new_tokens=12)
    recipe = parse_recipe(args)[0]
    recipe.target.path = str(target)
    run_stage("prepare", recipe)
    m = run_stage("regenerate", recipe)
    assert m["counts"]["kept"] == 7 and m["counts"]["prompt_mismatch"] == 0 and m["counts"]["answers_reencoded"] == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    special = set(tok.all_special_ids)
    samples = [s for p in sorted((tmp_path / "run" / "regen").glob("shard-*.safetensors")) for s in read_shard(p, False)]
    for s in samples:
        ids = s.input_ids
        with torch.no_grad():
            greedy = model(ids[None]).logits[0].argmax(-1)
        content = [t for t in range(1, len(ids)) if s.loss_mask[t] and int(ids[t]) not in special]
        assert content and all(int(greedy[t - 1]) == int(ids[t]) for t in content)
    # the case this guards against occurs here: re-encoding the text gives other tokens
    reencoded = sum(ids != tok(tok.decode(ids, skip_special_tokens=False), add_special_tokens=False)["input_ids"]
                    for ids in [s.input_ids.tolist() for s in samples])
    assert reencoded > 0


def test_local_fast_path_matches_generate(tmp_path):
    """regenerate.fast static (the plain decoding evaluate times: static KV cache, batches padded
    to a bucket size) writes the same conversations as transformers' generate, greedy, float32. The
    chunks hold 3 conversations and the batch is 4, so every call is padded (3 -> 4 rows); the
    two-turn conversation's second round is a batch of one (a new cache, then back to 4)."""
    got = {}
    for fast in ("off", "static"):
        d = tmp_path / fast
        d.mkdir()
        recipe = parse_recipe(_recipe(d, batch_size=4, keep_truncated=True, fast=fast))[0]
        run_stage("prepare", recipe)
        m = run_stage("regenerate", recipe)
        assert m["decoding_path"] == {"off": "generate", "static": "static"}[fast]
        got[fast] = _conversations(d / "run")
    assert len(got["off"]) == 7 and got["static"] == got["off"]
    assert len(got["off"][6]) == 4 and got["off"][6][3]["content"] != "Bye."  # both turns rewritten


def test_local_graphs_on_cpu_is_a_config_error(tmp_path, capsys):
    args = _recipe(tmp_path, fast="graphs")
    assert main(["prepare", *args]) == 0
    assert main(["regenerate", *args]) == 2
    assert "regenerate.fast 'graphs' needs a CUDA device (the target is on cpu)" in capsys.readouterr().err
    assert not list((tmp_path / "run" / "regen").glob("shard-*"))


def test_bucket_rows():
    """Later turns run on fewer rows than the first: n rounded up (powers of two, then multiples of 64), capped."""
    from draftsmith.data.regenerate import bucket_rows
    assert [bucket_rows(n, 1024) for n in (1, 2, 3, 5, 33, 64, 65, 700, 1000, 1024)] == \
        [1, 2, 4, 8, 64, 64, 128, 704, 1024, 1024]
    assert bucket_rows(3, 2) == 2 and bucket_rows(200, 128) == 128


def _cut_after_first_chunk(monkeypatch, recipe) -> None:
    """Run regenerate and interrupt it (KeyboardInterrupt) once its first chunk is done."""
    import draftsmith.data.regenerate as regen

    real, calls = regen.regenerate_conversations, []

    def cut_after_one(*args, **kw):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(regen, "regenerate_conversations", cut_after_one)
    with pytest.raises(KeyboardInterrupt):
        run_stage("regenerate", recipe)


def test_cut_off_run_keeps_its_finished_chunks_and_their_time(tmp_path, monkeypatch):
    """Interrupted after its first chunk (Ctrl-C, a job's time limit), regenerate has that chunk on disk
    with the time it took in the manifest; the rerun starts at the second chunk and adds its own time."""
    import draftsmith.data.regenerate as regen

    recipe = parse_recipe(_recipe(tmp_path, batch_size=4))[0]
    run_stage("prepare", recipe)
    real = regen.regenerate_conversations
    _cut_after_first_chunk(monkeypatch, recipe)
    m = load_manifest(tmp_path / "run" / "regen")
    assert m["status"] == "running" and len(m["shards"]) == 1 and m["timings"]["regenerate_s"] > 0
    first = m["timings"]["regenerate_s"]
    calls = []
    monkeypatch.setattr(regen, "regenerate_conversations", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    m = run_stage("regenerate", recipe)
    assert len(calls) == 2  # chunks 2 and 3 only (7 conversations, 3 per chunk)
    assert m["status"] == "complete" and m["timings"]["regenerate_s"] > first
    assert m["metrics"]["loss_tokens_per_s"] == round(m["counts"]["loss_tokens"] / m["timings"]["regenerate_s"], 1)


@pytest.mark.parametrize("fast", ["off", "static"])
def test_sampled_answers_are_a_function_of_the_seed(tmp_path, monkeypatch, fast):
    """At temperature > 0 each chunk draws from a generator seeded by (recipe seed, chunk): the same
    recipe writes the same answers, whether the run went through at once or was cut off after its
    first chunk and resumed (after other draws from torch's default generator); another seed writes
    others."""

    def run(name, seed=0, cut=False):
        d = tmp_path / name
        d.mkdir()
        args = _recipe(d, batch_size=4, keep_truncated=True, fast=fast, temperature=1.0)
        recipe = parse_recipe([*args, "--seed", str(seed)])[0]
        run_stage("prepare", recipe)
        if cut:
            with monkeypatch.context() as mp:
                _cut_after_first_chunk(mp, recipe)
            torch.rand(1000)  # the resumed process's default generator is elsewhere
        run_stage("regenerate", recipe)
        return _conversations(d / "run")

    once = run("once")
    assert len(once) == 7
    assert run("resumed", cut=True) == once
    other = run("seed1", seed=1)
    assert other.keys() == once.keys() and other != once


def test_server_requests_carry_a_seed_when_sampling(tmp_path, server):
    """Sampled server requests carry the OpenAI API's `seed`, a function of (recipe seed, chunk,
    messages): a rerun asks for the same draws, another recipe seed for others; greedy requests carry
    none. The seed joins the stage's fingerprint when sampling, so another seed regenerates a sampled
    stage and leaves a greedy one complete."""
    def seeds(name, seed=0, temperature=1.0):
        d = tmp_path / name
        d.mkdir()
        args = [*_recipe(d, server_url=server.url, temperature=temperature), "--prepare.max_samples", "3", "--seed", str(seed)]
        assert main(["prepare", *args]) == 0
        server.seeds.clear()
        assert main(["regenerate", *args]) == 0
        return sorted(server.seeds, key=str)

    first = seeds("a")
    assert len(first) == 3 and all(isinstance(x, int) and 0 <= x < 2 ** 31 for x in first) and len(set(first)) == 3
    assert seeds("b") == first
    assert set(seeds("c", seed=1)).isdisjoint(first)
    assert seeds("d", temperature=0.0) == [None] * 3

    def fp(seed, temperature):
        recipe = parse_recipe([*_recipe(tmp_path, temperature=temperature), "--seed", str(seed)])[0]
        return stage_fingerprint("regenerate", recipe, tmp_path / "run")

    assert fp(0, 1.0) != fp(1, 1.0) and fp(0, 0.0) == fp(1, 0.0)
