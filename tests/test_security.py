"""Security review as tests (docs/security.md): no pickle or eval anywhere, trust_remote_code off by
default and passed through, manifest paths cannot leave the run directory, regenerate talks
only to its configured URL."""
from __future__ import annotations

import dataclasses
import http.server
import json
import re
import threading
from pathlib import Path

import pytest
import yaml

from draftsmith import config as config_module
from draftsmith.data import regenerate
from draftsmith.manifests import verify_shards
from draftsmith.messages import DraftsmithError
from draftsmith.testing import make_model_dir

SRC = Path(__file__).parent.parent / "src" / "draftsmith"
RECIPES = Path(__file__).parent.parent / "recipes"

FORBIDDEN = {
    r"^\s*(import|from)\s+(pickle|cPickle|dill|joblib|marshal|shelve)\b": "pickle-family import",
    r"\bpickle\.(loads?|Unpickler)\b": "unpickling",
    r"(?<![\w.])(eval|exec)\(": "eval/exec",
    r"trust_remote_code\s*=\s*True": "trust_remote_code=True",
    r"trust_remote_code:\s*bool\s*=\s*True": "trust_remote_code defaulting to True",
    r"\byaml\.(load|unsafe_load)\(": "yaml.load (use yaml.safe_load)",
    r"shell\s*=\s*True": "subprocess with shell=True",
    r"allow_pickle\s*=\s*True": "numpy allow_pickle",
    r"weights_only\s*=\s*False": "torch.load(weights_only=False)",
}


def source_lines():
    for path in sorted(SRC.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            yield path.relative_to(SRC.parent), n, line


def test_no_pickle_eval_or_unsafe_loads_in_src():
    hits = [f"{p}:{n}: {why}: {line.strip()}" for p, n, line in source_lines()
            for pattern, why in FORBIDDEN.items() if re.search(pattern, line)]
    assert not hits, "\n".join(hits)


def test_torch_load_always_weights_only():
    text = {p: p.read_text(encoding="utf-8") for p in SRC.rglob("*.py")}
    for p, t in text.items():
        for m in re.finditer(r"torch\.load\(", t):
            call = t[m.start():t.find(")", m.start()) + 1]
            assert "weights_only=True" in call, f"{p}: {call}"


def test_trust_remote_code_defaults_off():
    for obj in vars(config_module).values():
        if dataclasses.is_dataclass(obj) and "trust_remote_code" in obj.__dataclass_fields__:
            assert obj().trust_remote_code is False, obj.__name__
    assert config_module.Recipe().target.trust_remote_code is False
    for recipe in sorted(RECIPES.glob("*.yaml")):
        assert (yaml.safe_load(recipe.read_text()) or {}).get("target", {}).get("trust_remote_code") in (None, False), recipe
    # every function that takes the flag defaults it to False
    import inspect

    import draftsmith.draft.build
    import draftsmith.export.sglang
    import draftsmith.target.model
    for module in (draftsmith.target.model, draftsmith.draft.build, draftsmith.export.sglang):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            p = inspect.signature(fn).parameters.get("trust_remote_code")
            assert p is None or p.default in (False, inspect.Parameter.empty), f"{module.__name__}.{name}"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("sec") / "t", num_layers=2, hidden_size=32)


@pytest.mark.parametrize("flag", [False, True])
def test_load_target_passes_trust_remote_code_through(target, monkeypatch, flag):
    import transformers

    from draftsmith.target.model import load_target

    seen = []
    for cls in (transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained.__func__

        def spy(klass, *a, _orig=original, **kw):
            seen.append((klass.__name__, kw.get("trust_remote_code", "not passed")))
            return _orig(klass, *a, **kw)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    load_target(target, device="cpu", dtype="float32", trust_remote_code=flag)
    assert {name for name, _ in seen} >= {"AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"}
    assert all(value is flag for _, value in seen), seen


def test_remote_code_in_a_model_folder_is_not_run(target, tmp_path):
    """A folder whose config asks for its own Python code: refused with a one-line error, the code never runs."""
    import shutil

    from draftsmith.target.model import load_target

    evil = tmp_path / "evil"
    shutil.copytree(target, evil)
    marker = tmp_path / "pwned"
    (evil / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (evil / "configuration_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    cfg = json.loads((evil / "config.json").read_text())
    cfg.update(model_type="evil_model", architectures=["EvilForCausalLM"],
               auto_map={"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (evil / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="trust_remote_code"):
        load_target(evil, device="cpu", dtype="float32")
    assert not marker.exists()


def test_pickled_weights_are_never_loaded(target, tmp_path):
    """A target folder with only a pickled pytorch_model.bin is refused, not unpickled."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from draftsmith.target.model import load_target

    folder = tmp_path / "bin"
    shutil.copytree(target, folder)
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(DraftsmithError, match="safetensors"):
        load_target(folder, device="cpu", dtype="float32")


# ----------------------------------------------------------------------------- run-directory paths


@pytest.mark.parametrize("rel", ["../../etc/passwd", "/etc/passwd", "shard/../../../x", "link/passwd"])
def test_manifest_paths_cannot_escape(tmp_path, rel):
    d = tmp_path / "run" / "data"
    d.mkdir(parents=True)
    (d / "link").symlink_to("/etc")
    with pytest.raises(DraftsmithError, match="escapes the run directory"):
        verify_shards(d, {"shards": [{"file": rel, "sha256": "0" * 64}]})


def test_symlinked_shard_pointing_outside_is_refused(tmp_path):
    d = tmp_path / "run" / "data"
    d.mkdir(parents=True)
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    (d / "shard-00000.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(DraftsmithError, match="escapes the run directory"):
        verify_shards(d, {"shards": [{"file": "shard-00000.safetensors", "sha256": "0" * 64}]})


# ----------------------------------------------------------------------------- regenerate's network use


class _Server:
    """A local HTTP server: `redirect_to` set -> every request is answered 302 there; else an
    OpenAI-style answer. Counts the requests it gets."""

    def __init__(self, redirect_to: str | None = None):
        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                hits.append(self.path)
                if redirect_to:
                    self.send_response(302)
                    self.send_header("Location", redirect_to + self.path)
                    self.end_headers()
                    return
                body = json.dumps({"data": [{"id": "m"}], "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            do_GET = do_POST = _answer

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_regenerate_refuses_redirects_and_ignores_proxies(monkeypatch):
    elsewhere, proxy = _Server(), _Server()
    redirector = _Server(redirect_to=elsewhere.url)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("http_proxy", proxy.url)
    try:
        cfg = config_module.RegenerateConfig(enabled=True, server_url=redirector.url + "/v1", max_retries=0, timeout_s=10)
        with pytest.raises(DraftsmithError, match="refused"):
            regenerate.ServerGenerator(cfg)  # GET /models is redirected
        cfg = dataclasses.replace(cfg, server_model="m")
        answers = regenerate.ServerGenerator(cfg)([[{"role": "user", "content": "hi"}]])
        assert answers[0].text is None and ("refused" in answers[0].error or "302" in answers[0].error)
        assert redirector.hits and not elsewhere.hits and not proxy.hits
        # the same client against a well-behaved server works, so the refusal above is the redirect
        ok = regenerate.ServerGenerator(dataclasses.replace(cfg, server_url=elsewhere.url + "/v1"))
        assert ok([[{"role": "user", "content": "hi"}]])[0].text == "hi"
        assert elsewhere.hits == ["/v1/chat/completions"] and not proxy.hits
    finally:
        for s in (elsewhere, proxy, redirector):
            s.close()


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/v1", "127.0.0.1:8000/v1"])
def test_regenerate_only_speaks_http(url):
    with pytest.raises(DraftsmithError, match="not an http"):
        regenerate.ServerGenerator(config_module.RegenerateConfig(enabled=True, server_url=url, server_model="m"))
