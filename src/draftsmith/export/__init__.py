"""The export stage: the trained drafter (train/drafter/) -> serving-engine folders under export/.

One converter per format, each with an explicit key map and its runtime's own layer-id
convention (DESIGN.md §4, export/conventions.py): sglang.py (SGLang-native
LlamaForCausalLMEagle3), vllm.py (the speculators format vLLM loads). Formats are checked
before anything is written. importer.py reads either format back (`draftsmith import-drafter`).
"""
from __future__ import annotations

from pathlib import Path

from ..fileio import sha256_file
from ..manifests import finish_manifest, new_manifest, require_complete, write_manifest
from ..messages import log
from ..rundir import RECIPE_FILE
from ..config import Recipe, check_recipe
from ..draft.io import read_drafter_config
from ..figures.export import ExportCounts, ExportFigures, ExportedFormat
from .sglang import export_sglang
from .vllm import export_vllm

def run(recipe: Recipe, run_dir: Path, fp: str) -> dict:
    cfg = recipe.export
    run_dir = Path(run_dir)
    out_dir = run_dir / "export"
    check_recipe(recipe, str(run_dir / RECIPE_FILE), only=("export",))  # checked at parse time too; again for a Recipe built in code
    train = require_complete(run_dir / "train", "train")
    drafter_dir = run_dir / "train" / "drafter"
    manifest = new_manifest("export", fp, cfg, {"train": train["fingerprint"],
                                                "drafter_sha256": sha256_file(drafter_dir / "model.safetensors")})
    out_dir.mkdir(parents=True, exist_ok=True)
    write_manifest(out_dir, manifest)
    formats: dict[str, ExportedFormat] = {}
    for fmt in cfg.formats:  # each format is a few seconds of work: redone whole on resume
        if fmt == "sglang":
            files = export_sglang(drafter_dir, recipe.target.path, out_dir / "sglang", cfg.dtype, cfg.with_embeddings,
                                  trust_remote_code=recipe.target.trust_remote_code)
        else:
            files = export_vllm(drafter_dir, recipe.target.path, out_dir / "vllm", cfg.dtype, cfg.verifier,
                                cfg.num_speculative_tokens, cfg.with_embeddings, recipe.target.trust_remote_code)
        formats[fmt] = ExportedFormat(dir=fmt, files=files)
        log(f"[export] {fmt}: {out_dir / fmt} ({sum(f['bytes'] for f in files) / 2**20:.1f} MiB, {cfg.dtype})")
    if read_drafter_config(drafter_dir / "config.json").norm_output:
        log("[export] norm_output (EAGLE-3.1) is on: serve with a vLLM that has vllm-project/vllm#46488 or an SGLang with "
            "EAGLE-3.1; an older release ignores the key and drafts worse without an error (docs/serving.md)")
    manifest.update(ExportFigures(formats=formats, counts=ExportCounts(formats=len(cfg.formats))).to_dict())
    return finish_manifest(out_dir, manifest)
