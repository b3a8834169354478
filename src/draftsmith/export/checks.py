"""Checks both directions of export/ share (sglang.py, vllm.py write a drafter; importer.py reads
one back): the vocab map is consistent, and the drafter fits the target it is served with.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..messages import DraftsmithError
from ..rundir import fix_command
from ..draft.build import rope_settings
from ..draft.model import Eagle3Config


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, where: str, fix: Optional[str] = None) -> None:
    """d2t offsets must land inside the target vocab, on distinct tokens, all marked in t2d. `fix`:
    what the error tells the user to do; default, for a drafter of a run (`where` inside its run
    directory): the commands that rebuild the vocab, retrain and export again."""
    if fix is None:
        fix = f"rerun {fix_command('vocab', where, then=('train', 'export'))}"
    target_ids = torch.arange(d2t.numel()) + d2t.long()
    V = t2d.numel()
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= V:
        raise DraftsmithError(f"{where}: d2t maps a draft token outside the target vocab of {V}; {fix}")
    if target_ids.unique().numel() != target_ids.numel():
        raise DraftsmithError(f"{where}: d2t maps two draft tokens to one target token; {fix}")
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[target_ids].all()):
        raise DraftsmithError(f"{where}: t2d does not mark exactly the d2t targets; {fix}")


def check_target(cfg: Eagle3Config, target_cfg, where: str) -> tuple[float, Optional[dict], int]:
    """(rope_theta, rope_scaling, max_position_embeddings) of the target, after checking that
    the drafter was trained for it (vocab, widths, rope, layer count)."""
    theta, scaling = rope_settings(target_cfg)
    max_pos = int(getattr(target_cfg, "max_position_embeddings", None) or cfg.max_position_embeddings)
    checks = {"vocab_size": (cfg.vocab_size, int(target_cfg.vocab_size)),
              "target_hidden_size": (cfg.target_hidden_size, int(target_cfg.hidden_size)),
              "rope_theta": (cfg.rope_theta, theta), "rope_scaling": (cfg.rope_scaling or None, scaling)}
    if cfg.target_num_layers:
        checks["target_num_layers"] = (cfg.target_num_layers, int(target_cfg.num_hidden_layers))
    bad = [f"{k} {a} != target's {b}" for k, (a, b) in checks.items() if a != b]
    if bad:
        raise DraftsmithError(f"{where}: drafter was not trained for this target ({'; '.join(bad)}); "
                              "set target.path to the model it was trained for")
    return theta, scaling, max_pos
