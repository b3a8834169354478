"""Training-time test (TTT): the EAGLE-3 loss over k unrolled draft steps (docs/CONTRACTS.md).

For a sample x[0..L-1] with aux states a[t] and the target's final hidden states f[t]:
    step 0:  h = fc(a[t]);   step i > 0: h = g of step i-1 at the same row
    g_i[t]  = drafter layer(input token x[t+1+i], h, rotary position t+i)
    target  = softmax(f[t+1+i] @ W_lm[draft ids].T)   # the target's next-token distribution
                                                       # at position t+1+i, restricted to the draft vocab
    CE_i    = sum_t w_i[t] * soft-CE(target, lm_head(norm(g_i[t]))) / sum_t w_i[t],
    w_i[t]  = loss_mask[t+2+i]  (0 past the end)
    loss    = sum_i decay**i * CE_i
Accuracy at position i: argmax of the draft == argmax of the restricted target, over weighted rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..draft.model import Eagle3Drafter


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar with grad: sum_i decay**i * CE_i
    ce: torch.Tensor  # [k] CE_i, detached
    correct: torch.Tensor  # [k] weighted count of argmax matches
    weight: torch.Tensor  # [k] sum of row weights


@torch.no_grad()
def target_distribution(final_hidden: torch.Tensor, head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs float32 [B, L, Vd], argmax [B, L]) of the target restricted to the draft vocab.
    head_weight [Vd, H] = the target's lm_head rows of the draft vocab."""
    logits = final_hidden.to(head_weight.dtype) @ head_weight.T
    return logits.float().softmax(-1), logits.argmax(-1)


def ttt_loss(model: Eagle3Drafter, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden: torch.Tensor,
             final_hidden: torch.Tensor, head_weight: torch.Tensor, steps: int, decay: float) -> TTTOutput:
    """The TTT loss of a right-padded batch: input_ids/loss_mask [B, L], aux_hidden [B, L, n_aux*H],
    final_hidden [B, L, H]. Padding needs token 0, mask 0: padded rows come after the real ones,
    so causal attention keeps them out of every real row."""
    B, L = input_ids.shape
    dev = input_ids.device
    probs, target_argmax = target_distribution(final_hidden, head_weight)
    ids_ext = F.pad(input_ids, (0, steps + 1))
    mask_ext = F.pad(loss_mask.float(), (0, 1))
    positions = torch.arange(L, device=dev)[None].expand(B, L)
    hidden = model.project(aux_hidden)
    cache: list = []
    loss = torch.zeros((), device=dev)
    ce_all, correct_all, weight_all = [], [], []
    for i in range(steps):
        g = model.ttt_step(ids_ext[:, 1 + i:1 + i + L], hidden, positions + i, cache)
        hidden = g
        rows = L - 1 - i  # rows t whose target position t+1+i exists
        if rows <= 0:  # batch shorter than the unroll: nothing left to predict
            for acc in (ce_all, correct_all, weight_all):
                acc.append(torch.zeros((), device=dev))
            continue
        logp = model.logits(g[:, :rows]).float().log_softmax(-1)
        w = mask_ext[:, 2 + i:2 + i + rows]
        ce = -(probs[:, 1 + i:1 + i + rows] * logp).sum(-1)
        wsum = w.sum()
        ce_i = (ce * w).sum() / wsum.clamp_min(1.0)
        loss = loss + decay ** i * ce_i
        hit = (logp.argmax(-1) == target_argmax[:, 1 + i:1 + i + rows]).float()
        ce_all.append(ce_i.detach())
        correct_all.append((hit * w).sum())
        weight_all.append(wsum)
    return TTTOutput(loss, torch.stack(ce_all), torch.stack(correct_all), torch.stack(weight_all))


def simulated_tau(acc: list[float]) -> float:
    """Simulated acceptance length of a chain of k drafts: tau = 1 + sum_i prod_{j<=i} acc_j.

    The target always yields one token; draft i is accepted only if drafts 0..i were, and
    acc_j (teacher-forced argmax agreement at position j) stands in for the conditional
    acceptance rate. It is an estimate: evaluate measures the real tau."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
