"""The evaluate stage: speculative decoding with the trained drafter against plain greedy decoding.

For every benchmark prompt (first user turn, rendered with the target's chat template) both
decoders run in this process, one after the other, after one warm-up. Reported:
    tau         tokens emitted per target verification forward (the target's own token counted)
    per position: P(accept | reached) and P(accept) for draft positions 1..k
    tokens/s of both decoders and the speedup (plain time / speculative time)
Speculative output must equal plain output (evaluate.check_lossless). Each prompt's result is
appended to eval/partial.jsonl, so a killed evaluation resumes after the last finished prompt.
"""
from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from .artifacts import (DraftsmithError, atomic_write_bytes, atomic_write_json, atomic_write_text, finish_manifest,
                        load_manifest, log, new_manifest, require_complete, sha256_file, stage_dir,
                        write_manifest)
from .config import Recipe
from .speculate.engine import plain_generate, speculative_generate

PARTIAL = "partial.jsonl"
# Relative top-1 vs chosen-token logit gap below which a divergence counts as a rounding tie:
# a verify forward over k+1 rows may round differently from single-row forwards.
TIE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


# ----------------------------------------------------------------------------- inputs


def load_models(recipe: Recipe, drafter_dir: Path):
    """The target (with the drafter's aux layers hooked) and the drafter, on one device and dtype."""
    from .draft.model import Eagle3Config, load_drafter
    from .target.model import load_target

    cfg_path = drafter_dir / "config.json"
    dcfg = Eagle3Config.load(cfg_path)
    t = recipe.target
    aux = dcfg.aux_layer_ids or t.aux_layer_ids
    if t.aux_layer_ids and dcfg.aux_layer_ids and list(t.aux_layer_ids) != list(dcfg.aux_layer_ids):
        raise DraftsmithError(f"{cfg_path}: drafter was trained on aux layers {dcfg.aux_layer_ids} but "
                              f"target.aux_layer_ids is {t.aux_layer_ids}; use the drafter's ids or retrain")
    target = load_target(t.path, device=t.device, dtype=t.dtype, trust_remote_code=t.trust_remote_code,
                         aux_layer_ids=aux)
    want = {"vocab_size": target.vocab_size, "target_hidden_size": target.hidden_size,
            "num_aux_layers": len(target.aux_layer_ids)}
    bad = {k: (getattr(dcfg, k), v) for k, v in want.items() if getattr(dcfg, k) != v}
    if bad:
        what = ", ".join(f"{k} {a} != target's {b}" for k, (a, b) in bad.items())
        raise DraftsmithError(f"{cfg_path}: drafter does not fit target {t.path} ({what}); retrain it for this target")
    drafter = load_drafter(drafter_dir, device=target.device, dtype=target.dtype)
    return target, drafter


def eos_token_ids(target) -> list[int]:
    ids = set()
    for v in (getattr(target.tokenizer, "eos_token_id", None),
              getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)):
        ids.update(v if isinstance(v, (list, tuple)) else [] if v is None else [v])
    return sorted(int(i) for i in ids)


def render_prompt(tokenizer, text: str, where: str) -> list[int]:
    """First user turn -> chat-template token ids, ending with the assistant header."""
    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError(f"{where}: the target tokenizer has no chat template; add `chat_template` to its "
                              "tokenizer_config.json (or a chat_template.jinja next to it)")
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
    except Exception as e:
        raise DraftsmithError(f"{where}: chat template failed ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                              "fix the prompt or the template") from None
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- one prompt


def _first_difference(a: list[int], b: list[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _near_tie(target, prompt_ids: list[int], plain: list[int], spec: list[int], pos: int) -> Optional[float]:
    """Relative logit gap between the two decoders' choices at the first differing position,
    from one uncached forward; None when it is no rounding tie (or one side ended)."""
    if pos >= min(len(plain), len(spec)):
        return None
    logits = target.forward(torch.tensor([prompt_ids + plain[:pos]], device=target.device)).logits[0, -1].float()
    top = logits.max()
    gap = float((top - logits[spec[pos]]) / top.abs().clamp(min=1.0))
    return gap if gap <= TIE_TOLERANCE.get(target.dtype, 1e-5) else None


def evaluate_prompt(target, drafter, prompt_ids: list[int], max_new_tokens: int, draft_steps: int,
                    eos_ids: list[int], check_lossless: bool, where: str) -> dict:
    t0 = time.perf_counter()
    plain = plain_generate(target, prompt_ids, max_new_tokens, eos_ids)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    plain_s = time.perf_counter() - t0
    spec, st = speculative_generate(target, drafter, prompt_ids, max_new_tokens, draft_steps, eos_ids)
    rec = {"prompt_tokens": len(prompt_ids), "new_tokens": len(spec), "plain_new_tokens": len(plain),
           "plain_s": plain_s, "spec_s": st.wall_s, "target_s": st.target_s, "draft_s": st.draft_s,
           "rounds": st.rounds, "emitted": sum(st.emitted_per_round),
           "drafted_per_round": st.drafted_per_round, "accepted_per_round": st.accepted_per_round,
           "drafted": st.drafted, "reached": st.reached, "accepted": st.accepted,
           "lossless": spec == plain, "first_difference": None, "near_tie_gap": None}
    if spec != plain:
        pos = _first_difference(plain, spec)
        gap = _near_tie(target, prompt_ids, plain, spec, pos)
        rec.update(first_difference=pos, near_tie_gap=gap)
        if check_lossless and gap is None:
            got = spec[pos] if pos < len(spec) else "end"
            want = plain[pos] if pos < len(plain) else "end"
            raise DraftsmithError(f"{where}: speculative output differs from plain greedy decoding at new token {pos} "
                                  f"(plain {want}, speculative {got}) and it is no rounding tie; this is a draftsmith "
                                  "bug, please report it (set evaluate.check_lossless false to measure anyway)")
    return rec


# ----------------------------------------------------------------------------- aggregation


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def summarize(records: list[dict], k: int) -> dict:
    def agg(rs: list[dict]) -> dict:
        new, plain_new = sum(r["new_tokens"] for r in rs), sum(r["plain_new_tokens"] for r in rs)
        spec_s, plain_s = sum(r["spec_s"] for r in rs), sum(r["plain_s"] for r in rs)
        return {"prompts": len(rs), "new_tokens": new, "rounds": sum(r["rounds"] for r in rs),
                "tau": _ratio(sum(r["emitted"] for r in rs), sum(r["rounds"] for r in rs)),
                "tokens_per_s_spec": _ratio(new, spec_s), "tokens_per_s_plain": _ratio(plain_new, plain_s),
                "speedup": _ratio(plain_s, spec_s), "spec_s": spec_s, "plain_s": plain_s,
                "target_s": sum(r["target_s"] for r in rs), "draft_s": sum(r["draft_s"] for r in rs)}

    per_pos = {name: [sum(r[name][j] for r in records) for j in range(k)] for name in ("drafted", "reached", "accepted")}
    hist = [0] * (k + 1)  # over rounds that drafted (the last round of a prompt may not)
    for r in records:
        for d, a in zip(r["drafted_per_round"], r["accepted_per_round"]):
            hist[a] += d > 0
    benchmarks = {}
    for r in records:
        benchmarks.setdefault(benchmark_name(r["benchmark"]), []).append(r)
    return {
        "overall": agg(records),
        "per_benchmark": {b: agg(rs) for b, rs in benchmarks.items()},
        "per_position": {**per_pos,
                         "accept_rate": [_ratio(a, n) for a, n in zip(per_pos["accepted"], per_pos["reached"])],
                         "accept_rate_unconditional": [_ratio(a, n) for a, n in zip(per_pos["accepted"], per_pos["drafted"])]},
        "accepted_length_histogram": hist,
        "lossless": {"checked": len(records), "identical": sum(r["lossless"] for r in records),
                     "near_tie_divergences": sum(r["near_tie_gap"] is not None for r in records)},
    }


# ----------------------------------------------------------------------------- outputs


def benchmark_name(bench: str) -> str:
    """`mtbench` stays; a path shows as its file name without .jsonl(.gz)."""
    name = bench.replace("\\", "/").rsplit("/", 1)[-1]
    for ext in (".gz", ".jsonl", ".json"):
        name = name[: -len(ext)] if name.endswith(ext) else name
    return name or bench


def _f(x: Optional[float], nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table_rows(summary: dict) -> list[list[str]]:
    rows = [["benchmark", "prompts", "tokens", "tau", "spec tok/s", "plain tok/s", "speedup"]]
    items = list(summary["per_benchmark"].items()) + [("all", summary["overall"])]
    for name, s in items:
        rows.append([name, str(s["prompts"]), str(s["new_tokens"]), _f(s["tau"]), _f(s["tokens_per_s_spec"], 1),
                     _f(s["tokens_per_s_plain"], 1), _f(s["speedup"])])
    return rows


def render_report(summary: dict, recipe: Recipe) -> str:
    def md(rows):
        return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
                          *("| " + " | ".join(r) + " |" for r in rows[1:])])

    e = recipe.evaluate
    pp = summary["per_position"]
    pos_rows = [["position", "drafted", "reached", "accepted", "accepted / reached", "accepted / drafted"]]
    for j in range(len(pp["drafted"])):
        pos_rows.append([str(j + 1), str(pp["drafted"][j]), str(pp["reached"][j]), str(pp["accepted"][j]),
                         _f(pp["accept_rate"][j], 3), _f(pp["accept_rate_unconditional"][j], 3)])
    hist = summary["accepted_length_histogram"]
    total = sum(hist) or 1
    hist_rows = [["accepted drafts", "rounds", "share"]] + [[str(a), str(n), f"{n / total:.1%}"] for a, n in enumerate(hist)]
    ll = summary["lossless"]
    return "\n\n".join([
        f"# Evaluation: {recipe.name}",
        f"Target `{recipe.target.path}`, chain drafting k={e.draft_steps}, greedy, max_new_tokens={e.max_new_tokens}. "
        "tau = tokens per target verification forward (the target's own token counted); "
        "speedup = plain decoding time / speculative decoding time, same process.",
        md(table_rows(summary)),
        "## Acceptance per draft position", md(pos_rows),
        "## Accepted drafts per round (rounds that drafted)", md(hist_rows),
        f"Lossless: {ll['identical']}/{ll['checked']} prompts token-identical to plain greedy decoding"
        + (f"; {ll['near_tie_divergences']} diverged at a rounding tie." if ll["near_tie_divergences"] else "."),
    ]) + "\n"


def plot_acceptance(summary: dict) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    hist = summary["accepted_length_histogram"]
    ax1.bar(range(len(hist)), hist, color="tab:blue")
    ax1.set(xlabel="accepted drafts per round", ylabel="rounds", title=f"tau = {_f(summary['overall']['tau'])}")
    pp = summary["per_position"]
    x = range(1, len(pp["accept_rate"]) + 1)
    w = 0.4
    ax2.bar([i - w / 2 for i in x], [r or 0 for r in pp["accept_rate"]], w, label="accepted / reached")
    ax2.bar([i + w / 2 for i in x], [r or 0 for r in pp["accept_rate_unconditional"]], w, label="accepted / drafted")
    ax2.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1), title="acceptance per position")
    ax2.set_xticks(list(x))
    ax2.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


# ----------------------------------------------------------------------------- stage


def _read_partial(path: Path) -> dict[str, dict]:
    """Finished prompts of an interrupted run; a torn last line is ignored."""
    done = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                done[rec["key"]] = rec
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return done


def _append(path: Path, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    from .data.readers import load_prompts

    cfg = recipe.evaluate
    run_dir = Path(run_dir)
    out_dir = stage_dir(run_dir, "evaluate")
    drafter_dir = stage_dir(run_dir, "train") / "drafter"
    train = require_complete(stage_dir(run_dir, "train"), "train")
    if cfg.draft_steps < 1 or cfg.max_new_tokens < 1:
        raise DraftsmithError(f"{run_dir / 'recipe.yaml'}: evaluate.draft_steps and evaluate.max_new_tokens must be >= 1")

    old = load_manifest(out_dir)
    resuming = old is not None and old.get("status") == "running" and old.get("fingerprint") == fp
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / PARTIAL
    if not resuming:
        partial.unlink(missing_ok=True)
    done = _read_partial(partial)

    target, drafter = load_models(recipe, drafter_dir)
    eos = eos_token_ids(target)
    todo = []
    for bench in cfg.benchmarks:
        for i, p in enumerate(load_prompts(bench, cfg.max_prompts)):
            where = f"{bench}: prompt {p.id}"
            todo.append((f"{bench}#{i}", bench, p, render_prompt(target.tokenizer, p.turns[0], where), where))

    manifest = new_manifest("evaluate", fp, cfg, {"train": train["fingerprint"],
                                                  "drafter_sha256": sha256_file(drafter_dir / "model.safetensors")})
    if resuming:
        manifest["started_at"] = old.get("started_at", manifest["started_at"])
    write_manifest(out_dir, manifest)
    if done:
        log(f"[evaluate] resuming: {len(done)}/{len(todo)} prompts already measured")

    k = cfg.draft_steps
    pending = [t for t in todo if t[0] not in done]
    if pending:  # warm-up: first calls pay for allocation and kernel selection
        ids = pending[0][3]
        plain_generate(target, ids, min(8, cfg.max_new_tokens), eos)
        speculative_generate(target, drafter, ids, min(8, cfg.max_new_tokens), k, eos)
    records = []
    for n, (key, bench, p, ids, where) in enumerate(todo, 1):
        if key in done:
            records.append(done[key])
            continue
        rec = {"key": key, "benchmark": bench, "id": p.id, "category": p.category,
               **evaluate_prompt(target, drafter, ids, cfg.max_new_tokens, k, eos, cfg.check_lossless, where)}
        _append(partial, rec)
        records.append(rec)
        log(f"[evaluate] {n}/{len(todo)} {where}: {rec['new_tokens']} tokens, "
            f"tau {_f(rec['emitted'] / rec['rounds'] if rec['rounds'] else None)}, "
            f"speedup {_f(rec['plain_s'] / rec['spec_s'] if rec['spec_s'] else None)}")

    summary = summarize(records, k)
    atomic_write_json(out_dir / "results.json", {"config": cfg, "eos_ids": eos, "summary": summary, "prompts": records})
    atomic_write_text(out_dir / "report.md", render_report(summary, recipe))
    atomic_write_bytes(out_dir / "acceptance.png", plot_acceptance(summary))
    _print_table(table_rows(summary))

    o = summary["overall"]
    manifest["counts"] = {"prompts": len(records), "new_tokens": o["new_tokens"], "rounds": o["rounds"],
                          "near_tie_divergences": summary["lossless"]["near_tie_divergences"]}
    manifest["metrics"] = {
        "tau": o["tau"], "tau_per_benchmark": {b: s["tau"] for b, s in summary["per_benchmark"].items()},
        "accept_rate_per_position": summary["per_position"]["accept_rate"],
        "accept_rate_per_position_unconditional": summary["per_position"]["accept_rate_unconditional"],
        "tokens_per_s_spec": o["tokens_per_s_spec"], "tokens_per_s_plain": o["tokens_per_s_plain"],
        "speedup": o["speedup"], "num_prompts": len(records), "draft_steps": k}
    manifest["timings"] = {"spec_s": o["spec_s"], "plain_s": o["plain_s"], "target_s": o["target_s"], "draft_s": o["draft_s"]}
    manifest["files"] = ["results.json", "report.md", "acceptance.png"]
    return finish_manifest(out_dir, manifest)
