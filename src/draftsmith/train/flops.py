"""FLOPs of drafter training per token, and peak FLOP/s of a device, for MFU.

Counted per real token of a sample of length L (mean causal context (L+1)/2), k TTT steps:
    fc          2 * (n_aux * H_t) * H                          once (step 0 input)
    per step i  q/k/v  2 * 2H * (nh + 2 nkv) * hd,  o  2 * nh * hd * H,
                MLP    2 * 3 * H * I,               lm_head 2 * H * Vd,
                attention (QK^T and PV) 4 * nh * hd * (context + i)
    training = 3 x forward (backward = 2 x forward) for all of the above
    target distribution (final_hidden @ W_lm[draft ids]) 2 * H_t * Vd, forward only
Embedding lookups and norms are not counted (negligible and not matmuls).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..draft.model import Eagle3Config

# Dense bf16 tensor-core peak (no sparsity), TFLOP/s, by substring of the device name.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "B200": 2250.0,
                    "A100": 312.0, "A800": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0}


def train_flops_per_token(cfg: Eagle3Config, steps: int, mean_context: float) -> float:
    H, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    fc = 2 * cfg.num_aux_layers * cfg.target_hidden_size * H
    layer = 2 * 2 * H * (nh + 2 * nkv) * hd + 2 * nh * hd * H + 2 * 3 * H * cfg.intermediate_size
    head = 2 * H * cfg.draft_vocab_size
    attn = sum(4 * nh * hd * (mean_context + i) for i in range(steps))
    target = 2 * cfg.target_hidden_size * cfg.draft_vocab_size
    return 3.0 * (fc + steps * (layer + head) + attn) + target


def peak_flops(device: torch.device, override_tflops: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of one device: the override, else the table for known GPUs, else None (CPU)."""
    if override_tflops:
        return float(override_tflops) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None
