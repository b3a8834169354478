"""Ragged sample shards in safetensors: the on-disk format between prepare, capture and train.

A shard holds n samples packed end to end:
    input_ids    int32 [T]          token ids of all samples
    loss_mask    uint8 [T]          1 where the token is assistant content (a training label)
    offsets      int64 [n + 1]      sample j is rows offsets[j]:offsets[j+1]
    sample_index int64 [n]          index of the conversation in the source (after skip)
and, in the safetensors metadata (shards written since source ids were kept; older shards lack it,
and readers then have no source ids):
    source_ids   JSON list [n]      each sample's record id in the source (ShareGPT `id`, ...)
Capture shards add, row-aligned with input_ids:
    aux_hidden   [T, n_aux * H]     outputs of the aux layers, concatenated (storage dtype)
    final_hidden [T, H]             the target's last hidden state after its final norm
fp8 capture shards (storage float8_e4m3) store both as float8_e4m3fn and add a float32 scale per
token and aux layer; value = fp8 * scale. Read them with `decode_hidden` / `read_hidden_rows`:
    aux_hidden_scale   float32 [T, n_aux]
    final_hidden_scale float32 [T, 1]
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..fileio import JSON_ERRORS, atomic_save_safetensors
from ..manifests import load_manifest
from ..messages import DraftsmithError
from ..rundir import redo_stage_hint


STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                  "float8_e4m3": torch.float8_e4m3fn}
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
HIDDEN = ("aux_hidden", "final_hidden")
SOURCE_IDS = "source_ids"


def bytes_per_token(num_aux: int, hidden_size: int, storage_dtype: str) -> int:
    """Disk bytes per captured token: aux + final hidden states (+ fp8 scales), ids (4) and mask (1)."""
    size = torch.empty(0, dtype=STORAGE_DTYPES[storage_dtype]).element_size()
    scales = (num_aux + 1) * 4 if storage_dtype == "float8_e4m3" else 0
    return (num_aux + 1) * hidden_size * size + scales + 5


def encode_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, W] -> (fp8 values [T, W], float32 scales [T, groups]): each row is cut into `groups`
    equal parts (one per aux layer, whose magnitudes differ), each scaled so its max is 448."""
    T, W = x.shape
    g = x.float().reshape(T, groups, W // groups)
    scale = (g.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    values = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.reshape(T, W), scale


def decode_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of encode_fp8, as float32."""
    T, W = values.shape
    G = scale.shape[-1]
    return (values.float().reshape(T, G, W // G) * scale.float()[..., None]).reshape(T, W)


def round_to_storage(x: torch.Tensor, storage_dtype: str, groups: int = 1) -> torch.Tensor:
    """What a [T, W] hidden state looks like after a trip through a shard of this storage dtype:
    what read_shard / decode_hidden give back (float8_e4m3 -> float32; others keep their dtype)."""
    if storage_dtype == "float8_e4m3":
        return decode_fp8(*encode_fp8(x, groups))
    return x.to(STORAGE_DTYPES[storage_dtype])


def decode_hidden(tensors, name: str) -> torch.Tensor:
    """Hidden state `name` (aux_hidden / final_hidden) of a shard's tensors as stored, fp8 decoded:
    float32 for fp8 shards (values * `name`_scale), the stored dtype otherwise. `tensors` is any
    mapping of the shard's tensors (safetensors load_file, or rows sliced from it)."""
    scale = tensors.get(name + "_scale") if hasattr(tensors, "get") else None
    return tensors[name] if scale is None else decode_fp8(tensors[name], scale)


def read_hidden_rows(handle, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of hidden state `name` from a `safetensors.safe_open` handle, fp8 decoded
    (the row slice of decode_hidden, without reading the rest of the shard)."""
    rows = {name: handle.get_slice(name)[start:stop]}
    if name + "_scale" in handle.keys():
        rows[name + "_scale"] = handle.get_slice(name + "_scale")[start:stop]
    return decode_hidden(rows, name)


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [L]
    loss_mask: torch.Tensor  # bool [L]
    sample_index: int
    aux_hidden: Optional[torch.Tensor] = None  # [L, n_aux * H]
    final_hidden: Optional[torch.Tensor] = None  # [L, H]
    source_id: Optional[str] = None  # the record's id in the source; None: a shard written before ids were kept

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def pack(samples: Sequence[Sample], storage_dtype: Optional[str] = None) -> dict[str, torch.Tensor]:
    """Tensors of a shard. With storage_dtype float8_e4m3 the hidden states are fp8-encoded
    (one scale per token and aux layer); other storage dtypes are applied by the caller."""
    lengths = torch.tensor([len(s) for s in samples], dtype=torch.int64)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    out = {
        "input_ids": torch.cat([s.input_ids.to(torch.int32) for s in samples]) if samples else torch.zeros(0, dtype=torch.int32),
        "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in samples]) if samples else torch.zeros(0, dtype=torch.uint8),
        "offsets": offsets,
        "sample_index": torch.tensor([s.sample_index for s in samples], dtype=torch.int64),
    }
    if samples and samples[0].aux_hidden is not None:
        out["aux_hidden"] = torch.cat([s.aux_hidden for s in samples])
        out["final_hidden"] = torch.cat([s.final_hidden for s in samples])
        if storage_dtype == "float8_e4m3":
            groups = out["aux_hidden"].shape[1] // out["final_hidden"].shape[1]
            out["aux_hidden"], out["aux_hidden_scale"] = encode_fp8(out["aux_hidden"], groups)
            out["final_hidden"], out["final_hidden_scale"] = encode_fp8(out["final_hidden"], 1)
    return out


def write_shard(path: str | Path, samples: Sequence[Sample], metadata: Optional[dict[str, str]] = None,
                storage_dtype: Optional[str] = None) -> dict:
    """Write a shard atomically. Returns its manifest entry (file, sha256, counts). The samples'
    source ids go into the metadata (`source_ids`) when every sample has one."""
    tensors = pack(samples, storage_dtype)
    if samples and all(s.source_id is not None for s in samples):
        metadata = {**(metadata or {}), SOURCE_IDS: json.dumps([s.source_id for s in samples])}
    sha = atomic_save_safetensors(path, tensors, metadata)
    return {"file": Path(path).name, "sha256": sha, "num_samples": len(samples),
            "num_tokens": int(tensors["input_ids"].shape[0]),
            "num_loss_tokens": int(tensors["loss_mask"].sum())}


def _redo(shard: str | Path) -> str:
    """The fix for a damaged shard: the command that redoes the stage of its folder (rundir.redo_stage_hint)."""
    folder = Path(shard).parent
    try:
        manifest = load_manifest(folder)
    except (DraftsmithError, OSError):
        manifest = None
    return redo_stage_hint(folder, manifest)


def _layout_problem(t: dict[str, torch.Tensor]) -> Optional[str]:
    """What is wrong with the layout of a shard's tensors (None: what `pack` writes): 1-D integer
    input_ids and sample_index, a 1-D loss_mask as long as input_ids, offsets rising from 0 to the
    token count with one more entry than samples, and hidden states of one row per token (an fp8
    one with a scale whose groups divide its width)."""
    ids, mask, off, idx = t["input_ids"], t["loss_mask"], t["offsets"], t["sample_index"]
    if any(x.dim() != 1 for x in (ids, mask, off, idx)) or any(x.is_floating_point() for x in (ids, off, idx)):
        return "input_ids, loss_mask, offsets and sample_index must be 1-D, the ids and offsets integers"
    n = ids.numel()
    if mask.numel() != n or off.numel() != idx.numel() + 1 or int(off[0]) != 0 or int(off[-1]) != n \
            or bool((off[1:] < off[:-1]).any()):
        return f"offsets {off.tolist()[:8]} do not split {n} tokens into {idx.numel()} samples"
    for name in ("aux_hidden", "final_hidden"):
        if name not in t:
            if name == "final_hidden" and "aux_hidden" in t:
                return "aux_hidden without final_hidden"
            continue
        h, scale = t[name], t.get(name + "_scale")
        if h.dim() != 2 or h.shape[0] != n:
            return f"{name} {list(h.shape)} is not one row per token ({n})"
        if scale is not None and (scale.dim() != 2 or scale.shape[0] != n or scale.shape[1] == 0 or h.shape[1] % scale.shape[1]):
            return f"{name}_scale {list(scale.shape)} does not fit {name} {list(h.shape)}"
    return None


def read_shard(path: str | Path, with_hidden: bool = True) -> list[Sample]:
    """Samples of a shard; hidden states as stored, fp8 ones decoded to float32."""
    try:
        t = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise DraftsmithError(f"{path}: unreadable shard ({e}); {_redo(path)}") from None
    need = {"input_ids", "loss_mask", "offsets", "sample_index"}
    if not need <= set(t):
        raise DraftsmithError(f"{path}: shard lacks {sorted(need - set(t))}; it was not written by draftsmith, {_redo(path)}")
    what = _layout_problem(t)
    if what:
        raise DraftsmithError(f"{path}: not a shard draftsmith wrote ({what}); {_redo(path)}")
    off = t["offsets"].tolist()
    ids = source_ids(path, len(off) - 1)
    hidden = with_hidden and "aux_hidden" in t
    if hidden:
        t["aux_hidden"], t["final_hidden"] = decode_hidden(t, "aux_hidden"), decode_hidden(t, "final_hidden")
    out = []
    for j in range(len(off) - 1):
        a, b = off[j], off[j + 1]
        out.append(Sample(
            input_ids=t["input_ids"][a:b].long(), loss_mask=t["loss_mask"][a:b].bool(),
            sample_index=int(t["sample_index"][j]),
            aux_hidden=t["aux_hidden"][a:b] if hidden else None,
            final_hidden=t["final_hidden"][a:b] if hidden else None,
            source_id=ids[j] if ids else None))
    return out


def source_ids(path: str | Path, num_samples: int, metadata: Optional[dict] = None) -> Optional[list[str]]:
    """The source ids of a shard's samples (its `source_ids` metadata; `metadata` if already read),
    or None for a shard written without them."""
    if metadata is None:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    raw = metadata.get(SOURCE_IDS)
    if raw is None:
        return None
    try:
        ids = json.loads(raw)
    except JSON_ERRORS:
        ids = None
    if not isinstance(ids, list) or len(ids) != num_samples or not all(isinstance(i, str) for i in ids):
        raise DraftsmithError(f"{path}: metadata `{SOURCE_IDS}` is not a list of {num_samples} strings; the shard is "
                              f"damaged, {_redo(path)}")
    return ids


def iter_samples(paths: Sequence[Path], with_hidden: bool = True) -> Iterator[Sample]:
    for p in paths:
        yield from read_shard(p, with_hidden)


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of similar length whose padded size fits batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur, cur_max = [], [], 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches
