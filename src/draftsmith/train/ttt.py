"""Training-time test (TTT): the EAGLE-3 loss over k unrolled draft steps (docs/CONTRACTS.md).

For a sample x[0..L-1] with aux states a[t] and the target's final hidden states f[t]:
    step 0:  h = fc(a[t]);   step i > 0: h = g of step i-1 at the same row
    g_i[t]  = drafter layer(input token x[t+1+i], h, rotary position t+i)
    target  = softmax(f[t+1+i] @ W_lm[draft ids].T / T)  # the target's next-token distribution
                                                       # at position t+1+i, restricted to the draft vocab
                                                       # (T = train.ttt_target_temperature, 1; 0: one-hot argmax)
    CE_i    = sum_t w_i[t] * soft-CE(target, lm_head(norm(g_i[t]))) / sum_t w_i[t],
    w_i[t]  = loss_mask[t+2+i]  (0 past the end)
    loss    = sum_i decay**i * CE_i
With align_topk k > 0 (train.ttt_align_topk) a row's loss at step i > 0 also needs the target's
token within the drafter's top-k at steps 0..i-1 of that row (its later drafts are verified only
then); the denominators stay the same.
Accuracy at position i: argmax of the draft == argmax of the restricted target, over weighted rows;
chain acceptance at i: the rows whose drafts matched at every step 0..i (1 + their sum over i is
the teacher-forced tau of a chain, which the engine reproduces on the target's own text).
Sampled acceptance at i (sample_temperature S > 0, evaluation only): sum_v min(p_S(v), q_S(v)) with
p_S, q_S the target's and the drafter's softmax(logits / S) over the draft vocab, the probability
that speculative sampling at temperature S accepts the drafter's token at that row (Leviathan et
al. 2023); greedy acceptance is its limit S -> 0. Like the accuracy, p is the target's law restricted
to the draft vocab: where the target puts mass outside it, the figure is an upper bound.

With gradient accumulation and several ranks, a micro-batch divides by the weight of the
whole global batch at each position (`weight_total`, known before the forward from the loss
masks), so summing the micro-batch losses over micro-batches and ranks gives exactly the loss
of the global batch: world size 1 and N take the same optimizer steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..costmodel import expected_tokens
from ..draft.model import Eagle3Drafter
from ..draft.rope import rope_cos_sin
from ..draft.ttt_attention import TTTMask, resolve_impl


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar with grad: sum_i decay**i * CE_i
    ce: torch.Tensor  # [k] CE_i, detached
    correct: torch.Tensor  # [k] weighted count of argmax matches
    weight: torch.Tensor  # [k] sum of row weights
    chain: torch.Tensor  # [k] weighted count of rows whose argmax matched at steps 0..i (a chain's acceptance)
    accept: Optional[torch.Tensor] = None  # [k] weighted sum of sum_v min(p_S, q_S), with sample_temperature S > 0


@torch.no_grad()
def target_distribution(final_hidden: torch.Tensor, head_weight: torch.Tensor,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs float32 [B, L, Vd], argmax [B, L]) of the target restricted to the draft vocab.
    head_weight [Vd, H] = the target's lm_head rows of the draft vocab. probs = softmax(logits / temperature);
    temperature 0: the argmax alone (one-hot: hard labels)."""
    logits = final_hidden.to(head_weight.dtype) @ head_weight.T
    top = logits.argmax(-1)
    if temperature == 0:
        return F.one_hot(top, logits.shape[-1]).float(), top
    logits = logits.float() if temperature == 1 else logits.float() / temperature  # no pass over [B, L, Vd] at 1
    return logits.softmax(-1), top


def position_weights(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """[steps] float64: the row weight sum_t w_i[t] of each TTT position for a [B, L] or [L] mask."""
    m = loss_mask.reshape(-1, loss_mask.shape[-1]).double()
    return torch.stack([m[:, 2 + i:].sum() for i in range(steps)])


def ttt_loss(model: Eagle3Drafter, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden: torch.Tensor,
             final_hidden: torch.Tensor, head_weight: torch.Tensor, steps: int, decay: float,
             weight_total: Optional[torch.Tensor] = None, attention: str = "auto",
             position_ids: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None,
             mask=None, align_topk: int = 0, temperature: float = 1.0, sample_temperature: float = 0.0) -> TTTOutput:
    """The TTT loss of a batch: input_ids/loss_mask [B, L], aux_hidden [B, L, n_aux*H],
    final_hidden [B, L, H]. Padded batches (doc_ids None): one sample per row from position 0,
    padding (token 0, mask 0) after it, so causal attention keeps it out of every real row.
    Packed batches: doc_ids [B, L] the sample of each row (non-decreasing; padding is a sample of
    its own), position_ids [B, L] restarting at 0 per sample; attention stays within a sample
    (TTTMask) and a row whose label t+2+i lies in another sample has weight 0, as past the end
    of a padded sample, so a packed batch gives the loss of its samples padded.
    `weight_total` [steps]: the denominators of CE_i (default: this batch's own position weights).
    `mask`: the batch's draft.ttt_attention.TTTMask, prepared (default: built here from doc_ids).
    `align_topk`: 0, or k: the loss of step i > 0 only at rows still aligned (module docstring).
    `temperature`: of the target distribution the drafter learns (target_distribution; 0: hard labels).
    `sample_temperature` S > 0: also the sampled acceptance per position (module docstring), in `accept`."""
    B, L = input_ids.shape
    dev = input_ids.device
    probs, target_argmax = target_distribution(final_hidden, head_weight, temperature)
    sampled = None
    if sample_temperature > 0:
        sampled = probs if sample_temperature == temperature else target_distribution(final_hidden, head_weight, sample_temperature)[0]
    ids_ext = F.pad(input_ids, (0, steps + 1))
    mask_ext = F.pad(loss_mask.float(), (0, 1))
    positions = torch.arange(L, device=dev)[None].expand(B, L) if position_ids is None else position_ids
    attn_mask = TTTMask(doc_ids) if mask is None else mask
    doc_ext = None if doc_ids is None else F.pad(doc_ids, (0, 1), value=-1)
    hidden = model.project(aux_hidden)
    cache: list = []
    chain = None  # [B, rows] rows whose drafts matched the target's argmax at every step so far
    alive = None  # [B, rows] rows whose drafts so far kept the target's token in the top-k (align_topk)
    loss = torch.zeros((), device=dev)
    ce_all, correct_all, weight_all, chain_all, accept_all = [], [], [], [], []
    for i in range(steps):
        g = model.ttt_step(ids_ext[:, 1 + i:1 + i + L], hidden, positions + i, cache, attention, attn_mask)
        hidden = g
        rows = L - 1 - i  # rows t whose target position t+1+i exists
        if rows <= 0:  # batch shorter than the unroll: nothing left to predict
            for acc in (ce_all, correct_all, weight_all, chain_all, accept_all):
                acc.append(torch.zeros((), device=dev))
            continue
        logp = model.logits(g[:, :rows]).float().log_softmax(-1)
        w = mask_ext[:, 2 + i:2 + i + rows]
        if doc_ext is not None:  # the label t+2+i must be in row t's sample
            w = w * (doc_ext[:, 2 + i:2 + i + rows] == doc_ids[:, :rows])
        ce = -(probs[:, 1 + i:1 + i + rows] * logp).sum(-1)
        wsum = w.sum()
        denom = wsum if weight_total is None else weight_total[i].to(device=dev, dtype=wsum.dtype)
        ce_i = (ce * (w if alive is None else w * alive[:, :rows])).sum() / denom.clamp_min(1.0)
        loss = loss + decay ** i * ce_i
        label = target_argmax[:, 1 + i:1 + i + rows]
        hit = (logp.argmax(-1) == label).float()
        chain = hit if chain is None else chain[:, :rows] * hit
        if align_topk == 1:
            alive = chain
        elif align_topk > 1:
            top = (logp.topk(align_topk, -1).indices == label[..., None]).any(-1).float()
            alive = top if alive is None else alive[:, :rows] * top
        ce_all.append(ce_i.detach())
        correct_all.append((hit * w).sum())
        weight_all.append(wsum)
        chain_all.append((chain * w).sum())
        if sampled is not None:
            q = logp.exp() if sample_temperature == 1 else (logp / sample_temperature).softmax(-1)  # = softmax(logits / S)
            accept_all.append((torch.minimum(sampled[:, 1 + i:1 + i + rows], q).sum(-1) * w).sum())
    return TTTOutput(loss, torch.stack(ce_all), torch.stack(correct_all), torch.stack(weight_all), torch.stack(chain_all),
                     torch.stack(accept_all) if sampled is not None else None)


def _inductor_workarounds() -> None:
    """Inductor's mix-order reduction fusion (torch 2.10+, on by default) fails an assertion while
    scheduling the TTT graph on an H200 (torch 2.11: `AssertionError: 65535 v.s. 65534`
    in get_numel_rnumel), so training crashed in its first step; it is turned off (a fusion of
    RMSNorm's two reductions, a few per cent at most). Older torch has no such option."""
    import torch._inductor.config as inductor_config  # loads inductor: only when compiling
    if hasattr(inductor_config.triton, "mix_order_reduction"):
        inductor_config.triton.mix_order_reduction = False


class TTTLoss(torch.nn.Module):
    """The drafter with its TTT loss as `forward`, so that FSDP2 (which hooks `forward`) sees
    one call per micro-batch: one all-gather of the parameters, one reduce-scatter of the
    gradients. Returns a tuple of tensors (loss, ce, correct, weight[, accept when sample_temperature > 0])
    for FSDP's output hooks.

    compile_backend ("inductor"; None: eager): ttt_loss runs torch.compile'd with it (dynamic=False;
    tests use "aot_eager", which traces the same graph without generating kernels), its k unrolled steps one graph: norms,
    rotary, SwiGLU, the lm_head's log-softmax and soft CE fuse into few kernels, and flex attention
    compiles inside the same graph. Meant for fixed shapes (packed batches: one compile) and flex
    attention (the chunked kernel's host-side block loop does not trace). The attention mask of a
    batch is built eagerly first (TTTMask.prepare) and passed in."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, attention: str = "auto",
                 compile_backend: Optional[str] = None, align_topk: int = 0, temperature: float = 1.0):
        super().__init__()
        self.drafter, self.steps, self.decay, self.attention = drafter, steps, decay, attention
        self.align_topk, self.temperature = align_topk, temperature
        self.compiled = compile_backend is not None
        if compile_backend == "inductor":
            _inductor_workarounds()
        self._loss = torch.compile(ttt_loss, backend=compile_backend, dynamic=False) if self.compiled else ttt_loss

    def forward(self, input_ids, loss_mask, aux_hidden, final_hidden, head_weight, weight_total, position_ids=None, doc_ids=None,
                sample_temperature: float = 0.0):
        B, L = input_ids.shape
        mask = TTTMask(doc_ids).prepare(resolve_impl(self.attention, input_ids.device), self.steps, B, L, input_ids.device)
        if self.compiled:  # the rotary tables come from transformers' rope init, which does not trace: look them up eagerly once
            rope_cos_sin(input_ids[:1, :1], self.drafter.cfg, torch.float32)
        out = self._loss(self.drafter, input_ids, loss_mask, aux_hidden, final_hidden, head_weight,
                         self.steps, self.decay, weight_total, self.attention, position_ids, doc_ids, mask,
                         self.align_topk, self.temperature, sample_temperature)
        return (out.loss, out.ce, out.correct, out.weight) + ((out.accept,) if sample_temperature > 0 else ())


def simulated_tau(acc: list[float]) -> float:
    """Simulated acceptance length of a chain of k drafts: tau = 1 + sum_i prod_{j<=i} acc_j.

    The target always yields one token; draft i is accepted only if drafts 0..i were, and
    acc_j (teacher-forced argmax agreement at position j) stands in for the conditional
    acceptance rate. It is an estimate: evaluate measures the real tau."""
    return expected_tokens(acc)
