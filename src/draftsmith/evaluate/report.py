"""The evaluate stage's summary and report: per method tau, acceptance per draft position, the
accepted-length histogram, tokens/s and speedup, per benchmark and per batch size; the results as
a table (stdout), report.md and acceptance.png.
"""
from __future__ import annotations

import io
from typing import Optional

from ..config import Recipe
from ..speculate.methods import method_depth


# ----------------------------------------------------------------------------- aggregation


def ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def _sum_or_none(xs) -> Optional[float]:
    """The sum, or None when a value is None (resident rounds do not split target and drafter time)."""
    xs = list(xs)
    return None if any(x is None for x in xs) else sum(xs)


def summarize_method(records: list[dict], method: str, k: int) -> dict:
    rows = [(r, r["methods"][method]) for r in records if method in r["methods"]]

    def agg(rs) -> dict:
        new, plain_new = sum(m["new_tokens"] for _, m in rs), sum(r["plain_new_tokens"] for r, _ in rs)
        spec_s, plain_s = sum(m["spec_s"] for _, m in rs), sum(r["plain_s"] for r, _ in rs)
        return {"prompts": len(rs), "new_tokens": new, "rounds": sum(m["rounds"] for _, m in rs),
                "tau": ratio(sum(m["emitted"] for _, m in rs), sum(m["rounds"] for _, m in rs)),
                "tokens_per_s_spec": ratio(new, spec_s), "tokens_per_s_plain": ratio(plain_new, plain_s),
                "speedup": ratio(plain_s, spec_s), "spec_s": spec_s, "plain_s": plain_s,
                **{k: _sum_or_none(m[k] for _, m in rs) for k in ("target_s", "draft_s")}}

    per_pos = {name: [sum(m[name][j] for _, m in rows) for j in range(k)] for name in ("drafted", "reached", "accepted")}
    hist = [0] * (k + 1)  # over rounds that drafted (the last round of a prompt may not)
    for _, m in rows:
        for d, a in zip(m["drafted_per_round"], m["accepted_per_round"]):
            hist[a] += d > 0
    benchmarks: dict[str, list] = {}
    for r, m in rows:
        benchmarks.setdefault(benchmark_name(r["benchmark"]), []).append((r, m))
    out = {"overall": agg(rows), "per_benchmark": {b: agg(rs) for b, rs in benchmarks.items()},
           "per_position": {**per_pos,
                            "accept_rate": [ratio(a, n) for a, n in zip(per_pos["accepted"], per_pos["reached"])],
                            "accept_rate_unconditional": [ratio(a, n) for a, n in zip(per_pos["accepted"], per_pos["drafted"])]},
           "accepted_length_histogram": hist}
    if rows and "lossless" in rows[0][1]:
        out["lossless"] = lossless_tally([m for _, m in rows])
    return out


def lossless_tally(checks: list[dict]) -> dict:
    """Lossless checks (measure.lossless_check's records) counted: checked, identical, and the
    divergences at a rounding tie and beyond it."""
    return {"checked": len(checks), "identical": sum(c["lossless"] for c in checks),
            "near_tie_divergences": sum(c.get("divergence") == "tie" or (c.get("divergence") is None
                                                                         and c["near_tie_gap"] is not None) for c in checks),
            "numeric_divergences": sum(c.get("divergence") == "numeric" for c in checks)}


def summarize(records: list[dict], batch_records: list[dict], cfg, methods: list[str]) -> dict:
    plain_new, plain_s = sum(r["plain_new_tokens"] for r in records), sum(r["plain_s"] for r in records)
    summary = {"plain": {"prompts": len(records), "new_tokens": plain_new, "plain_s": plain_s,
                         "tokens_per_s": ratio(plain_new, plain_s)},
               "methods": {m: summarize_method(records, m, method_depth(cfg, m)) for m in methods},
               "batches": {}}
    for B in sorted({r["batch_size"] for r in batch_records}):
        rs = [r for r in batch_records if r["batch_size"] == B]
        p_s, p_new = sum(r["plain_s"] for r in rs), sum(r["plain_new_tokens"] for r in rs)
        row = {"batches": len(rs), "plain_tokens_per_s": ratio(p_new, p_s), "methods": {},
               "plain_ms_per_step": ratio(1000 * p_s, sum(r.get("plain_steps", 0) for r in rs) or None)}
        for m in methods:
            ms = [r["methods"][m] for r in rs]
            s, new = sum(x["spec_s"] for x in ms), sum(x["new_tokens"] for x in ms)
            row["methods"][m] = {"tau": ratio(sum(x["emitted"] for x in ms), sum(x["rounds"] for x in ms)),
                                 "tokens_per_s": ratio(new, s), "speedup": ratio(p_s, s),
                                 "identical": sum(x["identical"] for x in ms),
                                 "ms_per_round": ratio(1000 * s, sum(x.get("batch_rounds", 0) for x in ms) or None)}
        summary["batches"][str(B)] = row
    return summary


# ----------------------------------------------------------------------------- outputs


PATH_TEXT = {"off": "eager transformers, dynamic KV cache", "static": "static KV cache, no CUDA graphs",
             "graphs": "static KV cache, CUDA graphs", "compile": "static KV cache, torch.compile, CUDA graphs"}


def benchmark_name(bench: str) -> str:
    """`mtbench` stays; a path shows as its file name without .jsonl(.gz)."""
    name = bench.replace("\\", "/").rsplit("/", 1)[-1]
    for ext in (".gz", ".jsonl", ".json"):
        name = name[: -len(ext)] if name.endswith(ext) else name
    return name or bench


def fmt(x: Optional[float], nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table_rows(summary: dict) -> list[list[str]]:
    """One row per method and benchmark (plus `all`); plain is the reference (speedup 1)."""
    rows = [["method", "benchmark", "prompts", "tokens", "tau", "tok/s", "speedup", "lossless"]]
    for m, s in summary["methods"].items():
        items = list(s["per_benchmark"].items())
        items = (items if len(items) > 1 else []) + [("all", s["overall"])]
        ll = s.get("lossless")
        for name, a in items:
            rows.append([m, name, str(a["prompts"]), str(a["new_tokens"]), fmt(a["tau"]), fmt(a["tokens_per_s_spec"], 1),
                         fmt(a["speedup"]), f"{ll['identical']}/{ll['checked']}" if ll and name == "all" else "-"])
    p = summary["plain"]
    rows.append(["plain", "all", str(p["prompts"]), str(p["new_tokens"]), "1.00", fmt(p["tokens_per_s"], 1), "1.00", "-"])
    for B, row in summary["batches"].items():
        for m, a in row["methods"].items():
            rows.append([f"{m} bs{B}", "all", str(row["batches"]) + " batches", "-", fmt(a["tau"]), fmt(a["tokens_per_s"], 1),
                         fmt(a["speedup"]), "-"])
    return rows


def _md(rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
                      *("| " + " | ".join(r) + " |" for r in rows[1:])])


def render_report(summary: dict, recipe: Recipe, temperature: Optional[float] = None) -> str:
    """The report of one temperature's summary; `temperature` names it in the title (several in one run)."""
    e = recipe.evaluate
    T = e.temperature if temperature is None else temperature
    mode = "greedy" if T <= 0 else f"sampling at temperature {T:g}"
    title = f"# Evaluation: {recipe.name}" + ("" if temperature is None else f", temperature {temperature:g}"
                                             + (" (served)" if temperature == e.temperature else ""))
    parts = [title,
             f"Target `{recipe.target.path}`, {mode}, max_new_tokens={e.max_new_tokens}; eagle3_chain k={e.draft_steps}, "
             f"eagle3_tree depth={e.tree_depth} top-k={e.tree_topk} budget={e.tree_budget}, ngram k={e.ngram_steps or e.draft_steps}, "
             "hybrid = that tree with the n-gram continuation grafted on, one verify "
             f"(n <= {e.ngram_max}). tau = tokens per target verification forward (the target's own token counted); "
             "speedup = plain decoding time / method time, same target, same process, same decoding path "
             f"(`{summary.get('path', 'off')}`: {PATH_TEXT.get(summary.get('path', 'off'), '')}).",
             _md(table_rows(summary))]
    r = summary.get("roofline")
    if r and r.get("fraction_of_measured_bw") is not None:
        nominal = f", {r['fraction_of_nominal_bw']:.2f} of the {r['hardware']} data-sheet {r['nominal_bw_gbps']:.0f} GB/s" \
            if r.get("fraction_of_nominal_bw") else ""
        parts.append(f"Plain decoding at batch 1 runs at {r['plain_tokens_per_s']:.1f} tokens/s, reading "
                     f"{r['weight_bytes_per_step'] / 1e6:.1f} MB of weights per token: {r['fraction_of_measured_bw']:.3f} of the "
                     f"memory-bandwidth limit ({r['measured_bw_gbps']:.0f} GB/s measured by a copy{nominal}). "
                     "Speedups over a baseline far below that limit overstate what a serving engine would see.")
    for m, s in summary["methods"].items():
        pp = s["per_position"]
        pos_rows = [["depth", "drafted", "reached", "accepted", "accepted / reached", "accepted / drafted"]]
        for j in range(len(pp["drafted"])):
            pos_rows.append([str(j + 1), str(pp["drafted"][j]), str(pp["reached"][j]), str(pp["accepted"][j]),
                             fmt(pp["accept_rate"][j], 3), fmt(pp["accept_rate_unconditional"][j], 3)])
        hist = s["accepted_length_histogram"]
        total = sum(hist) or 1
        hist_rows = [["accepted drafts", "rounds", "share"]] + [[str(a), str(n), f"{n / total:.1%}"] for a, n in enumerate(hist)]
        parts += [f"## {m}: acceptance per draft position", _md(pos_rows),
                  f"## {m}: accepted drafts per round (rounds that drafted)", _md(hist_rows)]
        ll = s.get("lossless")
        if ll:
            ties, numeric = ll["near_tie_divergences"], ll.get("numeric_divergences", 0)
            unexplained = ll["checked"] - ll["identical"] - ties - numeric
            spot = " (sampled figures above; this is a greedy decoding of the first turns)" if ll.get("greedy_spot_check") else ""
            parts.append(f"Lossless{spot}: {ll['identical']}/{ll['checked']} prompts token-identical to plain greedy decoding"
                         + (f"; {ties} diverged at a rounding tie" if ties else "")
                         + (f"; {numeric} where an independent forward agreed with neither decoder (rounding beyond "
                            "the tie tolerance)" if numeric else "")
                         + (f"; **{unexplained} unexplained** (an independent forward agreed with plain decoding)"
                            if unexplained else "") + ".")
    return "\n\n".join(parts) + "\n"


def plot_acceptance(summary: dict) -> bytes:
    """Left: share of rounds by accepted drafts, per method. Right: P(accept | reached) per depth."""
    # why here: matplotlib takes about 0.7 s to import, and only this function draws
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    methods = summary["methods"]
    w = 0.8 / max(len(methods), 1)
    for i, (m, s) in enumerate(methods.items()):
        hist = s["accepted_length_histogram"]
        total = sum(hist) or 1
        ax1.bar([a + (i - (len(methods) - 1) / 2) * w for a in range(len(hist))], [n / total for n in hist], w,
                label=f"{m} (tau {fmt(s['overall']['tau'])})")
        rates = s["per_position"]["accept_rate"]
        ax2.bar([j + 1 + (i - (len(methods) - 1) / 2) * w for j in range(len(rates))], [r or 0 for r in rates], w, label=m)
    ax1.set(xlabel="accepted drafts per round", ylabel="share of rounds", title="accepted length")
    ax2.set(xlabel="draft depth", ylabel="accepted / reached", ylim=(0, 1), title="acceptance per draft position")
    for ax in (ax1, ax2):
        if methods:
            ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
