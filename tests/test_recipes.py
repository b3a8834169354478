"""The shipped recipes parse, and recipes/gpu.yaml (what a user copies for one GPU) stays the
shape of benchmarks/recipes/h200.yaml (what the project measures on the H200)."""
from pathlib import Path

import pytest
import yaml

from draftsmith.messages import DraftsmithError
from draftsmith.config import parse_recipe
from draftsmith.pipeline import target_fingerprint, write_recipe

ROOT = Path(__file__).resolve().parents[1]
GPU, H200, QUICKSTART = ROOT / "recipes/gpu.yaml", ROOT / "benchmarks/recipes/h200.yaml", ROOT / "recipes/quickstart.yaml"

# Keys of train/regenerate that the two recipes may set differently, and why.
DIFFERENCES = {
    "regenerate.max_new_tokens": "h200's 255M-parameter reference target: 256 tokens; a real chat model: 1024",
    "regenerate.keep_truncated": "the reference target's greedy answers often run on; a real model's end",
    "regenerate.batch_size": "h200 decodes its small target 256 at a time; 64 fits a real model's KV cache",
    "train.max_length": "the reference target's conversations are prepared at 1024 tokens",
    "train.max_minutes": "the benchmark trains its whole epochs; a user's run is budgeted",
    "train.eval_every": "the benchmark pins its cadence (50); a user's run takes about 10 evaluations",
    "regenerate.temperature": "the benchmark decodes greedily, where greedy answers won 1.15x tree tau; a user's server "
                              "samples, where answers sampled at 1 won 1.73x at temperature 1 (BENCHMARKS.md, twenty-first session)",
    "train.keep_best": "the benchmark keeps the drafter by greedy held-out tau (the default); a user's server samples",
    "train.ttt_target_temperature": "the benchmark decodes greedily, where 0.5 won 8.5 % tree tau; a user's server samples, "
                                    "where 0.5 lost 26 % chain tau at temperature 1 (BENCHMARKS.md, nineteenth session)",
}


@pytest.mark.parametrize("path", [GPU, H200, QUICKSTART])
def test_recipes_parse(path):
    recipe, _ = parse_recipe([str(path)])
    # every recipe trains on the target's own answers; the quickstart captures once and regenerates first
    # answers only: online training and every turn cost too much on 2 CPU cores (its comments)
    assert recipe.regenerate.enabled
    assert recipe.train.online or (path == QUICKSTART and recipe.regenerate.max_turns == 1)
    assert recipe.train.heldout_samples != 0 and recipe.train.eval_every != 0  # held-out on in every recipe
    assert recipe.train.heldout_engine_prompts > 0
    assert recipe.train.head_init == "target"
    # the quickstart trains at the defaults (the CPU lab's winners); the GPU recipes at what won on the
    # GPU at equal data with the peer (BENCHMARKS.md, tenth, twelfth and nineteenth sessions): 8,192 tokens a
    # step, Muon at 3e-3 on the matrices, AdamW at 1e-3 on the lm_head and norms
    cpu = path == QUICKSTART
    assert (recipe.train.lr, recipe.train.optimizer, recipe.train.muon_lr) == ((3e-3, "adamw", None) if cpu else (1e-3, "muon", 3e-3))
    assert cpu or recipe.train.batch_tokens == 8192


def test_gpu_recipe_keeps_h200s_shape():
    gpu, h200 = (yaml.safe_load(p.read_text()) for p in (GPU, H200))
    for section in ("train", "regenerate"):
        for key in sorted(set(gpu[section]) | set(h200[section])):
            name = f"{section}.{key}"
            if name in DIFFERENCES:
                continue
            assert key in gpu[section] and key in h200[section], f"{name} set in one recipe only; set it in both or list it in DIFFERENCES"
            assert gpu[section][key] == h200[section][key], f"{name}: gpu {gpu[section][key]!r} vs h200 {h200[section][key]!r}"
    assert gpu["train"]["max_minutes"] > 0  # a user's run has a budget


def test_gpu_recipe_placeholder_must_be_set():
    recipe, _ = parse_recipe([str(GPU)])
    with pytest.raises(DraftsmithError, match=r"target.path '<your model folder>' is the recipe's placeholder.*--target.path DIR"):
        target_fingerprint(recipe)
    recipe, _ = parse_recipe([str(GPU), "--target.path", "/nonexistent/model"])
    with pytest.raises(DraftsmithError, match=r"/nonexistent/model/config.json: target model not found"):
        target_fingerprint(recipe)


def test_a_runs_recipe_names_where_its_relative_paths_start(tmp_path, monkeypatch):
    """run_dir/recipe.yaml keeps the quickstart's relative paths as given and names the directory that
    wrote it; read from another directory, the not-found error says where it looked."""
    monkeypatch.chdir(ROOT)
    recipe, _ = parse_recipe([str(QUICKSTART), "--run_dir", str(tmp_path / "run")])
    (tmp_path / "run").mkdir()
    write_recipe(recipe, tmp_path / "run")
    text = (tmp_path / "run" / "recipe.yaml").read_text()
    assert text.startswith(f"# This run's recipe, written by draftsmith in {ROOT};")
    again, _ = parse_recipe([str(tmp_path / "run" / "recipe.yaml")])
    assert again == recipe and again.target.path == "assets/tiny-llama-sharegpt"
    target_fingerprint(again)  # found from ROOT
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DraftsmithError, match=rf"assets/tiny-llama-sharegpt/config.json: target model not found \(relative to "
                                              rf"the current directory {tmp_path}\); set target.path"):
        target_fingerprint(again)
