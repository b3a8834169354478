"""bench-serve against OpenAI-compatible servers started here on 127.0.0.1: a deterministic stub
(with and without speculative decoding), servers that error, stall and drop connections, and a
tiny HF model. Checks counts, golden acceptance figures from /metrics, files, ledger, no hangs."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from draftsmith import cli
from draftsmith.messages import DraftsmithError
from draftsmith.rundir import Ledger
from draftsmith.serve import bench as bench_mod
from draftsmith.serve.bench import BenchServeConfig, percentiles, run
from draftsmith.serve.metrics import parse_prometheus, spec_window
from draftsmith.serve.stub import FAULTS, StubServer, hf_generator
from draftsmith.testing import make_model_dir

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"question {i}: " + "words " * i}) + "\n" for i in range(5)))
    return str(p)


def bench(prompts, tmp_path, **kw) -> dict:
    """run() in a thread that must finish: a hang fails the test instead of stalling the suite."""
    kw = {"prompts": prompts, "concurrency": [1, 4], "requests_per_level": 8, "max_tokens": 16, "warmup_requests": 0,
          "out_dir": str(tmp_path / "out"), "progress": False, **kw}
    box: dict = {}

    def target():
        try:
            box["res"] = run(BenchServeConfig(**kw))
        except Exception as e:  # re-raised in the test thread
            box["err"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "bench-serve hung"
    if "err" in box:
        raise box["err"]
    return box["res"]


def test_ab_sweep_with_spec_decode_metrics(prompts, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with StubServer(step_s=0.001) as plain, StubServer(step_s=0.001, spec_k=3, model_name="m-eagle3") as spec:
        rc = cli.main(["bench-serve", "--url", plain.url, "--label", "plain", "--url_b", spec.url, "--label_b", "eagle3",
                       "--prompts", prompts, "--concurrency", "[1,4]", "--requests_per_level", "8", "--max_tokens", "16",
                       "--api", "completions", "--warmup_requests", "1", "--run_dir", str(run_dir), "--progress", "false"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "A/B (eagle3 / plain)" in printed and "wrote" in printed
    res = json.loads((run_dir / "bench_serve" / "results.json").read_text())
    assert (run_dir / "bench_serve" / "bench_serve.png").stat().st_size > 1000
    assert [e["model"] for e in res["endpoints"]] == ["stub", "m-eagle3"]
    for label in ("plain", "eagle3"):
        levels = res["levels"][label]
        assert [lv["concurrency"] for lv in levels] == [1, 4]
        for lv in levels:
            assert lv["ok"] == lv["requests"] == 8 and lv["errors"] == {}
            assert lv["output_tokens"] == 8 * 16 and lv["tokens_from"] == ["usage"]
            assert lv["tokens_per_s"] > 0 and lv["ttft_ms"]["p50"] > 0 and lv["tpot_ms"]["p99"] >= lv["tpot_ms"]["p50"]
    assert all(lv["spec_decode"] is None for lv in res["levels"]["plain"])
    # Golden: every 16-token request takes steps accepting 3,1,2,0,3,1 drafts of k=3.
    for lv in res["levels"]["eagle3"]:
        sd = lv["spec_decode"]
        assert (sd["source"], sd["drafts"], sd["draft_tokens"], sd["accepted_tokens"]) == ("vllm", 48, 144, 80)
        assert sd["mean_acceptance_length"] == pytest.approx(1 + 10 / 6)
        assert sd["accept_rate_per_position"] == pytest.approx([5 / 6, 3 / 6, 2 / 6])
    assert [r["concurrency"] for r in res["ab"]] == [1, 4] and all(r["tokens_per_s_ratio"] > 0 for r in res["ab"])
    event = Ledger(run_dir).read()[-1]
    assert event["event"] == "bench_serve" and event["ab"] == res["ab"]
    assert event["summary"]["eagle3"]["single_stream_tpot_ms"] == res["levels"]["eagle3"][0]["tpot_ms"]["p50"]
    assert event["summary"]["plain"]["levels"][1]["mean_acceptance_length"] is None


# what each stub fault must be reported as (serve/stub.py FAULTS)
FAULT_KINDS = {"error": "http_500", "stall": "timeout", "hang": "timeout", "drop": "dropped", "bad_json": "bad_response",
               "bad_sse": "bad_sse", "bad_shape": "bad_sse", "forever": "overlong"}


def expected_errors(faults) -> dict:
    out: dict = {}
    for f in faults:
        if f != "ok":
            out[FAULT_KINDS[f]] = out.get(FAULT_KINDS[f], 0) + 1
    return out


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_every_server_fault_is_a_counted_error_with_a_line(prompts, tmp_path, api, capsys):
    """Each fault of the stub, once per level: 500, a stall after the first token, no answer at all,
    a dropped connection, a cut-off JSON body, a chunk that is not JSON and one that is not a chunk
    object, mid-stream, and a stream past max_tokens.
    Each failed request gets one stderr line; results.json counts them by kind; the run ends in bounded time."""
    assert set(FAULT_KINDS) | {"ok"} == set(FAULTS)
    with StubServer(step_s=0.001, faults=FAULTS) as s:
        res = bench(prompts, tmp_path, url=s.url, api=api, concurrency=[1, 2], requests_per_level=len(FAULTS),
                    request_timeout_s=1.0, level_timeout_s=20.0)
    err = capsys.readouterr().err
    for lv in res["levels"]["A"]:
        assert lv["requests"] == len(FAULTS) and lv["ok"] == 1 and lv["failed"] == len(FAULTS) - 1
        assert lv["errors"] == expected_errors(FAULTS)
        assert "injected server error" in lv["error_examples"]["http_500"]
        assert lv["output_tokens"] == 16
        assert sorted(f["request"] for f in lv["failures"]) == sorted(set(range(len(FAULTS))) - {FAULTS.index("ok")})
        for f in lv["failures"]:
            assert f"A c={lv['concurrency']} request {f['request']}: {f['error']}" in err.splitlines()
    assert res["failed"] == {"A": {"requests": 2 * len(FAULTS), "failed": 2 * (len(FAULTS) - 1),
                                   "by_kind": {k: 2 * n for k, n in sorted(expected_errors(FAULTS).items())}}}
    assert res["wall_s"] < 2 * 20.0  # each level ends by its deadline (bench() also fails a hang)


def test_an_endless_sse_line_fails_the_request(prompts, tmp_path, monkeypatch):
    """A server that streams bytes without a newline fails that request once the line passes
    MAX_SSE_LINE, instead of growing the client's memory until the deadline."""
    monkeypatch.setattr(bench_mod, "MAX_SSE_LINE", 4096)
    with StubServer(step_s=0.0, generator=lambda prompt, n, chat: iter(["x" * 10_000] * n)) as s:
        res = bench(prompts, tmp_path, url=s.url, concurrency=[1], requests_per_level=2, request_timeout_s=30.0)
    (lv,) = res["levels"]["A"]
    assert lv["errors"] == {"bad_sse": 2} and "longer than 4096 bytes" in lv["error_examples"]["bad_sse"]


def test_level_deadline_cancels_and_counts_unsent(prompts, tmp_path):
    with StubServer(step_s=0.001, faults=("stall",)) as s:
        res = bench(prompts, tmp_path, url=s.url, concurrency=[2], requests_per_level=6, request_timeout_s=30.0,
                    level_timeout_s=1.0)
    (lv,) = res["levels"]["A"]
    assert lv["ok"] == 0 and lv["requests"] == 6
    assert lv["errors"] == {"timeout": 2, "not_sent": 4}
    assert lv["tokens_per_s"] == 0 and lv["tpot_ms"]["p50"] is None


def test_unreachable_and_broken_servers_fail_early(prompts, tmp_path, capsys):
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(DraftsmithError, match=r"cannot list the served models .*--model"):
        bench(prompts, tmp_path, url=f"http://127.0.0.1:{port}/v1")
    with StubServer(faults=("error",)) as s, pytest.raises(DraftsmithError, match="every warm-up request failed .*http_500"):
        bench(prompts, tmp_path, url=s.url, warmup_requests=2)
    err = capsys.readouterr().err  # one line per failed warm-up request
    assert "A warm-up request 0: http_500: injected server error" in err and "A warm-up request 1: http_500" in err
    with pytest.raises(DraftsmithError, match="not an http"):
        bench(prompts, tmp_path, url="127.0.0.1:8000")
    assert cli.main(["bench-serve", "--no_such_flag", "1"]) == 2


def test_tiny_model_server(prompts, tmp_path):
    model_dir = make_model_dir(tmp_path / "tiny", num_layers=1, hidden_size=32)
    with StubServer(step_s=0.0, generator=hf_generator(model_dir), model_name="tiny") as s:
        res = bench(prompts, tmp_path, url=s.url, api="chat", concurrency=[1, 2], requests_per_level=2, max_tokens=6,
                    metrics_url="none")
    for lv in res["levels"]["A"]:
        assert lv["ok"] == 2 and lv["output_tokens"] == 12 and lv["spec_decode"] is None


VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="k2"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="k2"} 100.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="k2"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="k2"} 600.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="k2"} 360.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="k2",position="0"} 160.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="k2",position="1"} 120.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="k2",position="2"} 80.0
"""


def test_prometheus_spec_decode_window():
    after = parse_prometheus(VLLM_METRICS)
    half = re.sub(r"_total(\{.*\}) (\S+)", lambda m: f"_total{m.group(1)} {float(m.group(2)) / 2}", VLLM_METRICS)
    before = parse_prometheus(half)
    w = spec_window(before, after)
    assert (w["drafts"], w["draft_tokens"], w["accepted_tokens"]) == (100, 300, 180)
    assert w["acceptance_rate"] == pytest.approx(0.6) and w["mean_acceptance_length"] == pytest.approx(2.8)
    assert w["accept_rate_per_position"] == pytest.approx([0.8, 0.6, 0.4])
    sglang = parse_prometheus('sglang:spec_accept_length{model_name="m",tp_rank="0"} 3.25\n'
                              'sglang:spec_accept_rate{model_name="m",tp_rank="0"} 0.56\n')
    assert spec_window(None, sglang) == {"source": "sglang", "mean_acceptance_length": 3.25, "acceptance_rate": 0.56}
    assert spec_window(None, parse_prometheus("vllm:num_requests_running 3\n")) is None


def test_percentiles_match_numpy_linear():
    v = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    p = percentiles(v)
    assert (p["p50"], p["p90"], p["mean"]) == (3.5, 7.5, 25 / 6) and p["p99"] == pytest.approx(9.75)
    assert percentiles([])["p50"] is None


def _all_outputs(capsys, run_dir) -> str:
    """Everything bench-serve wrote: stdout, stderr, results.json and the ledger."""
    printed = capsys.readouterr()
    files = "".join(p.read_text() for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl"))
    return printed.out + printed.err + files


def test_api_key_from_env_sent_as_bearer_and_never_written(prompts, tmp_path, capsys, monkeypatch):
    key = "sk-very-secret-4242"
    run_dir = tmp_path / "run"
    args = ["bench-serve", "--prompts", prompts, "--concurrency", "[1]", "--requests_per_level", "3", "--max_tokens", "8",
            "--warmup_requests", "1", "--run_dir", str(run_dir), "--progress", "false", "--api", "completions"]
    with StubServer(step_s=0.001, api_key=key) as s:
        # without the key the server refuses: a one-line error, exit 2
        assert cli.main([*args, "--url", s.url, "--model", "stub"]) == 2
        assert s.unauthorized > 0
        monkeypatch.setenv("BENCH_KEY", key)
        n = s.unauthorized
        assert cli.main([*args, "--url", s.url, "--api_key_env", "BENCH_KEY"]) == 0
        assert s.unauthorized == n  # every request carried the bearer token
        monkeypatch.delenv("BENCH_KEY")
        assert cli.main([*args, "--url", s.url, "--api_key_env", "BENCH_KEY"]) == 2
    out = _all_outputs(capsys, run_dir)
    assert "BENCH_KEY is not set" in out and key not in out
    res = json.loads((run_dir / "bench_serve" / "results.json").read_text())
    assert res["levels"]["A"][0]["ok"] == 3 and res["config"]["api_key_env"] == "BENCH_KEY"


def test_credentials_in_urls_are_redacted_everywhere(prompts, tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    with StubServer(step_s=0.001) as s:
        url = s.url.replace("http://", "http://alice:hunter2pw@")
        metrics = s.url.replace("/v1", "/metrics").replace("http://", "http://bob:metricspw@")
        assert cli.main(["bench-serve", "--url", url, "--metrics_url", metrics, "--prompts", prompts, "--concurrency", "[1]",
                         "--requests_per_level", "2", "--max_tokens", "8", "--warmup_requests", "0", "--run_dir", str(run_dir),
                         "--progress", "false"]) == 0
        # a failing run names its URL in the error: redacted too
        monkeypatch.setenv("WRONG", "wrong-key-555")
    bad = "http://carol:s3cretpw@127.0.0.1:9/v1?api_key=qwerty987"
    assert cli.main(["bench-serve", "--url", bad, "--prompts", prompts, "--concurrency", "[1]", "--run_dir", str(run_dir),
                     "--progress", "false", "--api_key_env", "WRONG"]) == 2
    out = _all_outputs(capsys, run_dir)
    for secret in ("hunter2pw", "qwerty987", "metricspw", "s3cretpw", "wrong-key-555", "alice:", "carol:"):
        assert secret not in out, secret
    assert "***@127.0.0.1" in out
    res = json.loads((run_dir / "bench_serve" / "results.json").read_text())
    assert res["levels"]["A"][0]["ok"] == 2


def test_metrics_with_a_non_numeric_position_label():
    text = ('vllm:spec_decode_num_drafts_total 10\nvllm:spec_decode_num_draft_tokens_total 30\n'
            'vllm:spec_decode_num_accepted_tokens_total 12\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="zero"} 5\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4\n')
    w = spec_window(None, parse_prometheus(text))
    assert w["mean_acceptance_length"] == pytest.approx(2.2)


def test_requests_sample_at_the_evaluated_temperature(prompts, tmp_path):
    """Without --temperature the requests sample at the temperature run_dir's evaluate measured at (a
    recipe for a sampling server, recipes/gpu.yaml), greedy without a run or an evaluation; an
    explicit --temperature wins. The temperature used is in results.json."""
    from draftsmith.manifests import finish_manifest, new_manifest
    from draftsmith.rundir import stage_dir

    run_dir = tmp_path / "run"
    with StubServer(step_s=0.001) as srv:
        kw = dict(url=srv.url, concurrency=[1], requests_per_level=2)
        assert bench(prompts, tmp_path, run_dir=str(run_dir), **kw)["config"]["temperature"] == 0.0
        ev = stage_dir(run_dir, "evaluate")
        ev.mkdir(parents=True)
        finish_manifest(ev, new_manifest("evaluate", "fp", {"temperature": 0.7}, {}))
        assert bench(prompts, tmp_path, run_dir=str(run_dir), **kw)["config"]["temperature"] == 0.7
        assert bench(prompts, tmp_path, run_dir=str(run_dir), temperature=0.0, **kw)["config"]["temperature"] == 0.0
        assert bench(prompts, tmp_path, **kw)["config"]["temperature"] == 0.0


def test_api_key_never_leaves_the_environment_under_every_fault(prompts, tmp_path):
    """A real `draftsmith bench-serve` process, the key in an environment variable, against a server
    that needs it, quotes it back in its errors (echo_auth) and fails in every way it can. No piece
    of the key (8 characters or more) is in stdout, stderr or any file the run wrote (results.json,
    the plot, the ledger); the results still count every failure by kind."""
    key = "Zq7TESTSECRET-sk-4f9b2c71d0e8a6"
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_PROXY") and not k.endswith("_proxy")}
    env |= {"BENCH_SERVE_KEY": key, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)}
    with StubServer(step_s=0.001, faults=FAULTS, api_key=key, echo_auth=True) as s:
        proc = subprocess.run(
            [sys.executable, "-m", "draftsmith.cli", "bench-serve", "--url", s.url, "--api_key_env", "BENCH_SERVE_KEY",
             "--prompts", prompts, "--concurrency", "[1,2]", "--requests_per_level", str(len(FAULTS)), "--max_tokens", "16",
             "--warmup_requests", "1", "--request_timeout_s", "1", "--level_timeout_s", "20", "--run_dir", str(run_dir),
             "--out_dir", str(out_dir), "--api", "completions"],
            capture_output=True, env=env, timeout=120)
        assert s.unauthorized == 0  # every request carried the key
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    blobs = {"stdout": proc.stdout, "stderr": proc.stderr}
    blobs |= {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "prompts.jsonl"}
    assert {run_dir / "ledger.jsonl", out_dir / "results.json", out_dir / "bench_serve.png"} <= {Path(n) for n in blobs}
    pieces = {key[i:i + 8].encode() for i in range(len(key) - 7)}
    leaks = [(name, piece) for name, blob in blobs.items() for piece in pieces if piece in blob]
    assert not leaks, leaks
    assert b"Authorization: Bearer ***" in proc.stderr  # the echoed header is there, its value redacted
    res = json.loads((out_dir / "results.json").read_text())
    assert res["failed"]["A"]["failed"] == 2 * (len(FAULTS) - 1)
    assert res["failed"]["A"]["by_kind"] == {k: 2 * n for k, n in sorted(expected_errors(FAULTS).items())}
    assert f"A: {2 * (len(FAULTS) - 1)} of {2 * len(FAULTS)} requests failed" in proc.stdout.decode()
    assert Ledger(run_dir).read()[-1]["summary"]["A"]["errors_by_kind"] == res["failed"]["A"]["by_kind"]


def test_a_key_given_in_place_of_its_variable_name_is_not_repeated(prompts, tmp_path, capsys):
    """`--api_key_env sk-...` (the key where its variable's name belongs): a one-line error that
    says what to give instead and does not print the key back."""
    key = "sk-live-Xy7PASTEDKEY-9281"
    assert cli.main(["bench-serve", "--url", "http://127.0.0.1:9/v1", "--prompts", prompts, "--api_key_env", key,
                     "--out_dir", str(tmp_path / "out"), "--progress", "false"]) == 2
    err = capsys.readouterr().err
    assert "not an environment variable name" in err and "PASTEDKEY" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
