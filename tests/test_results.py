"""Figures with a source (issue 21 item 9): every key of benchmarks/results/h200.json is what
benchmarks/collect_h200.py computes from the run folders its `_source` names (and from the very
files it lists); figures no script recomputes live in h200-history.json, apart."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def collect_module():
    spec = importlib.util.spec_from_file_location("collect_h200", ROOT / "benchmarks" / "collect_h200.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_headline_figure_is_recomputed_from_its_run():
    data = json.loads((RESULTS / "h200.json").read_text())
    source = data.pop("_source")
    used: dict = {}
    figures = collect_module().collect([ROOT / d for d in source["run_dirs"]], used)
    assert json.loads(json.dumps(figures)) == data
    assert {k: Path(v).relative_to(ROOT).as_posix() for k, v in used.items()} == source["files"]


def test_history_is_apart():
    headline = json.loads((RESULTS / "h200.json").read_text())
    history = json.loads((RESULTS / "h200-history.json").read_text())
    assert not (set(headline) - {"_source"}) & (set(history) - {"_about"})


def test_a_partial_peer_result_is_refused(tmp_path):
    """A bench_peer file its call's limit cut (`partial`, only our side measured) gives no
    peer_tau_ratio: collect stops in one line naming the file."""
    import pytest

    source = json.loads((RESULTS / "h200.json").read_text())["_source"]
    cut = tmp_path / "ours-s0-bench_peer.json"
    cut.write_text(json.dumps({"partial": "seed 0: ours measured, the peer not yet", "ours": [{"seed": 0}], "theirs": []}))
    with pytest.raises(SystemExit, match=f"{cut}: a partial bench_peer result"):
        collect_module().collect([ROOT / d for d in source["run_dirs"]] + [tmp_path])
