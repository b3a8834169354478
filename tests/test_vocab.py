import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.fileio import read_json
from draftsmith.manifests import finish_manifest, new_manifest, write_manifest
from draftsmith.messages import DraftsmithError
from draftsmith.config import Recipe, TargetConfig, VocabConfig
from draftsmith.testing import tiny_config
from draftsmith.draft.vocab import draft_ids, load_vocab
from draftsmith.vocab import build_vocab, run


def test_build_vocab_golden():
    counts = torch.tensor([5, 0, 3, 3, 9, 0, 1])
    d2t, t2d = build_vocab(counts, 10, 4)  # counts padded to V=10; tie 2/3 -> both, by id
    assert d2t.tolist() == [0, 1, 1, 1]  # target ids 0, 2, 3, 4
    assert t2d.tolist() == [True, False, True, True, True, False, False, False, False, False]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool

    d2t, t2d = build_vocab(counts, 10, 5)  # tie at the cut: 6 (count 1) is the 5th
    assert draft_ids(d2t).tolist() == [0, 2, 3, 4, 6]


def test_build_vocab_fills_unseen_by_lowest_id_and_clips():
    counts = torch.tensor([0, 4, 0, 2])
    d2t, t2d = build_vocab(counts, 6, 3)  # seen 1, 3; then lowest unseen 0
    assert d2t.tolist() == [0, 0, 1]
    assert t2d.tolist() == [True, True, False, True, False, False]
    d2t, t2d = build_vocab(counts, 6, 100)  # clipped to V
    assert d2t.tolist() == [0] * 6 and bool(t2d.all())


def _run_dir(tmp_path, counts, vocab_size=12):
    model_dir = tmp_path / "target"
    tiny_config(vocab_size=vocab_size).save_pretrained(str(model_dir))
    run_dir = tmp_path / "run"
    (run_dir / "data").mkdir(parents=True)
    save_file({"counts": counts}, str(run_dir / "data" / "token_counts.safetensors"))
    m = new_manifest("prepare", "fp-prepare", {}, {})
    write_manifest(run_dir / "data", m)
    finish_manifest(run_dir / "data", m)
    return Recipe(run_dir=str(run_dir), target=TargetConfig(path=str(model_dir))), run_dir


def test_vocab_stage_writes_vocab_and_coverage(tmp_path):
    counts = torch.tensor([0, 0, 10, 5, 0, 3, 2], dtype=torch.int64)  # tokenizer vocab 7 < model vocab 12
    recipe, run_dir = _run_dir(tmp_path, counts)
    recipe.vocab = VocabConfig(draft_vocab_size=3)
    m = run(recipe, run_dir, "fp")
    assert m["status"] == "complete" and m["draft_vocab_size"] == 3
    assert m["metrics"]["coverage"] == pytest.approx(18 / 20)
    t = load_file(str(run_dir / "vocab" / "vocab.safetensors"))
    assert draft_ids(t["d2t"]).tolist() == [2, 3, 5]
    assert t["t2d"].shape == (12,) and int(t["t2d"].sum()) == 3
    d2t, t2d = load_vocab(run_dir / "vocab" / "vocab.safetensors")
    assert torch.equal(d2t, t["d2t"])
    assert read_json(run_dir / "vocab" / "manifest.json")["status"] == "complete"


def test_vocab_stage_draft_vocab_past_the_tokenizer(tmp_path):
    """A draft vocab larger than the tokenizer's ids (model vocab 12, tokenizer 7): the unseen
    model ids fill it and count 0 toward the coverage (they once indexed past the counts)."""
    recipe, run_dir = _run_dir(tmp_path, torch.tensor([0, 0, 10, 5, 0, 3, 2], dtype=torch.int64))
    recipe.vocab = VocabConfig(draft_vocab_size=9)
    m = run(recipe, run_dir, "fp")
    assert m["draft_vocab_size"] == 9 and m["metrics"]["coverage"] == 1.0
    assert draft_ids(load_vocab(run_dir / "vocab" / "vocab.safetensors")[0]).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]


def test_vocab_stage_rejects_counts_beyond_model_vocab(tmp_path):
    counts = torch.zeros(14, dtype=torch.int64)
    counts[13] = 1
    recipe, run_dir = _run_dir(tmp_path, counts)
    with pytest.raises(DraftsmithError, match="token_counts.safetensors: tokens with ids >= 12"):
        run(recipe, run_dir, "fp")


def test_vocab_stage_missing_counts_names_the_whole_rerun_command(tmp_path):
    """The fix names a command that runs as pasted: the stage, the run's recipe.yaml and --force
    (a bare `draftsmith prepare --force` would run the default recipe); one line."""
    recipe, run_dir = _run_dir(tmp_path, torch.tensor([1, 2, 3], dtype=torch.int64))
    (run_dir / "data" / "token_counts.safetensors").unlink()
    with pytest.raises(DraftsmithError) as e:
        run(recipe, run_dir, "fp")
    assert str(e.value).endswith(f"not found; rerun `draftsmith prepare {run_dir / 'recipe.yaml'} --force`")
    assert "\n" not in str(e.value)
