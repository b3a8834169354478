"""Classic speculative decoding baseline: an independent small draft model of the target's family.

`IndependentDraftProposer` wraps a second Hugging Face causal LM with its own KV cache and
plugs into `speculative_generate` like any Proposer. It only sees token ids, so it is usable
only when both models share a tokenizer; `load_draft_model` checks that first
(compat.check_tokenizers) and fails with a one-line explanation otherwise.

Cache bookkeeping: the draft cache holds a prefix of `tokens` (committed) followed by the
drafts fed while proposing. After a round, the drafts the target accepted are already in the
cache, so only the rejected tail is cropped and only the bonus token is fed next round.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from ..compat import cache_kwargs, output_cache, require_compatible_tokenizers
from ..target.model import TargetOutput, load_tokenizer, resolve_device, resolve_dtype
from .cache import crop_cache
from .tree import DraftTree


class IndependentDraftProposer:
    """Drafts greedily (or by sampling, temperature > 0) with a small causal LM.

    With temperature > 0, `draft_probs` holds the draft distribution q(.|prefix) of each
    proposed token ([n, V] float32, V = target_vocab_size when given: a sibling model's
    embedding may be padded differently), and `propose_tree` hands them to the engine's
    speculative-sampling verifier."""

    def __init__(self, model: Any, temperature: float = 0.0, seed: int = 0, target_vocab_size: Optional[int] = None):
        self.model = model.eval()
        self.temperature = temperature
        self.target_vocab_size = target_vocab_size
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.tokens: list[int] = []
        self.cache: Any = None
        self.cached = 0                      # positions of `tokens` (then drafts) held in the cache
        self.fed_drafts: list[int] = []      # drafts fed into the cache after `tokens`
        self.draft_probs: Optional[torch.Tensor] = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(self, ids: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True, **cache_kwargs(self.model, self.cache))
        self.cache = output_cache(out)
        self.cached += len(ids)
        return out.logits[0, -1].float()

    def _pick(self, logits: torch.Tensor, probs: list[torch.Tensor]) -> int:
        if self.temperature <= 0:
            return int(logits.argmax())
        p = torch.softmax(logits / self.temperature, -1).cpu()
        V = self.target_vocab_size
        if V is not None and V != p.numel():  # ids past the target's vocab get no mass
            p = torch.nn.functional.pad(p, (0, max(V - p.numel(), 0)))[:V]
            p = p / p.sum()
        probs.append(p.to(logits.device))  # the verifier compares q with the target's p on its device
        return int(torch.multinomial(p, 1, generator=self.gen))

    @torch.inference_mode()
    def start(self, tokens: list[int], out: TargetOutput) -> None:
        self.tokens, self.cache, self.cached, self.fed_drafts = list(tokens), None, 0, []
        if len(tokens) > 1:  # prefill all but the last token; propose feeds it
            self._forward(tokens[:-1])

    @torch.inference_mode()
    def propose(self, k: int) -> list[int]:
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        if k <= 0:
            return drafts
        logits = self._forward(self.tokens[self.cached:])
        for j in range(k):
            drafts.append(self._pick(logits, probs))
            if j < k - 1:
                logits = self._forward(drafts[-1:])
        self.fed_drafts = drafts[:-1]
        self.draft_probs = torch.stack(probs) if probs else None
        return drafts

    def propose_tree(self, depth: int):
        """A chain, with the draft distributions when sampling (tree.DraftTree)."""
        drafts = self.propose(depth)
        q = list(self.draft_probs) if self.draft_probs is not None and drafts else None
        return DraftTree.chain(drafts, q)

    def commit(self, new_tokens: list[int], out: TargetOutput) -> None:
        keep = 0  # fed drafts the target committed: their cache rows stay valid
        while keep < min(len(self.fed_drafts), len(new_tokens) - 1) and self.fed_drafts[keep] == new_tokens[keep]:
            keep += 1
        self.cached = len(self.tokens) + keep
        if self.cache is not None:
            crop_cache(self.cache, self.cached)
        self.tokens += new_tokens
        self.fed_drafts = []


def load_draft_model(path: str | Path, target_tokenizer: Any, target_name: str = "target",
                     device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False) -> Any:
    """Load a local HF causal LM as an independent draft model, after checking that its
    tokenizer matches the target's (raises DraftsmithError explaining the mismatch)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    draft_tok = load_tokenizer(path, trust_remote_code)
    require_compatible_tokenizers(target_tokenizer, draft_tok, target_name, str(path))
    dev = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype, dev),
                                                 trust_remote_code=trust_remote_code)
    return model.to(dev).eval().requires_grad_(False)
