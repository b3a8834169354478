"""Render a conversation with the tokenizer's own chat template and build its assistant-only loss mask.

The loss mask covers the tokens of each assistant content plus the end-of-turn token the template
writes right after it (<|eot_id|>, <|im_end|>, <｜end▁of▁sentence｜>, <|end|>, ...): what the model
generates in that turn. Role headers, system and user turns are never covered.

Method: render the text once with the real contents and once with a unique placeholder per message
(the "skeleton"). The skeleton splits the template's output into frames (headers, separators) and
message slots, so each content is located exactly where the template put it, even when the same
words occur in a header or an earlier turn. Templates that rewrite content (`| trim`, dropping a
`<think>` block) are matched by trying those rewrites; a template whose frames change with the
content (a think block inserted before the content) is matched tolerantly from the first point
where text and frame differ. Character spans become token spans through the fast tokenizer's
offset mapping; a token overlapping an assistant span is a loss token.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..messages import DraftsmithError


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool
    eot_missing: int = 0
    """Assistant turns whose content is not followed directly by a special token (no EOT learned)."""
    unspliced: int = 0
    """Answers given as token ids that kept their text's tokens instead (render's answer_ids)."""
    answer_starts: list[int] = field(default_factory=list)
    """Index in input_ids (before the cut to max_length) where each assistant content begins."""


def tokenizer_name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def apply_template(tokenizer: Any, messages: Sequence[dict]) -> str:
    """The chat template's text for `messages` (no generation prompt), as a string."""
    name = tokenizer_name(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError(f"tokenizer {name}: has no chat template; add `chat_template` to its tokenizer_config.json "
                              "(or a chat_template.jinja next to it)")
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=False)
    except Exception as e:  # jinja2 TemplateError, raise_exception() in the template, ValueError
        msg = " ".join(str(e).split())[:300]
        raise DraftsmithError(f"tokenizer {name}: chat template failed ({type(e).__name__}: {msg}); "
                              "fix the conversation (roles/order the template accepts) or the template") from None
    if not isinstance(text, str):
        raise DraftsmithError(f"tokenizer {name}: apply_chat_template(tokenize=False) returned {type(text).__name__}, "
                              "not a string; upgrade transformers (>=5)")
    return text


def _placeholder_char(contents: Sequence[str]) -> str:
    for cp in range(0xE000, 0xF900):  # Unicode private use area: never in real text, untouched by trim
        ch = chr(cp)
        if not any(ch in c for c in contents):
            return ch
    raise DraftsmithError("conversation uses every private-use character; cannot place content markers")


def _variants(content: str) -> list[str]:
    """How templates commonly rewrite a content: verbatim, trimmed, reasoning dropped."""
    after_think = content.split("</think>")[-1]
    out: list[str] = []
    for v in (content, content.strip(), content.rstrip(), content.lstrip(), after_think, after_think.lstrip("\n"),
              after_think.strip()):
        if v and v not in out:
            out.append(v)
    return out


def _common_prefix(a: str, b: str, b_start: int) -> int:
    n = 0
    while n < len(a) and b_start + n < len(b) and a[n] == b[b_start + n]:
        n += 1
    return n


def content_spans(tokenizer: Any, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Rendered text and the character span [start, end) of every assistant content in it, in order."""
    name = tokenizer_name(tokenizer)
    text = apply_template(tokenizer, messages)
    contents = [m["content"] for m in messages]
    ph = _placeholder_char(contents)
    skeleton = apply_template(tokenizer, [{**m, "content": f"{ph}{i}{ph}"} for i, m in enumerate(messages)])
    slots = [(mt.start(), mt.end(), int(mt.group(1))) for mt in re.finditer(re.escape(ph) + r"(\d+)" + re.escape(ph), skeleton)]
    frames = [skeleton[: slots[0][0]] if slots else skeleton]
    frames += [skeleton[slots[k][1]: slots[k + 1][0]] for k in range(len(slots) - 1)]
    frames += [skeleton[slots[-1][1]:]] if slots else []

    spans, pos = [], 0
    for k, (_, _, i) in enumerate(slots):
        frame, nxt, last = frames[k], frames[k + 1], k == len(slots) - 1
        exact = text.startswith(frame, pos)
        start = pos + (len(frame) if exact else _common_prefix(frame, text, pos))

        def locate(strict: bool) -> int:
            """End of the first content variant found here, followed by the next frame (strict) or
            by its beginning (the next frame itself changed with the content, e.g. a think block)."""
            for v in _variants(contents[i]):
                if exact:
                    j = start if text.startswith(v, start) else -1
                elif last:
                    j = len(text) - len(nxt) - len(v) if text.endswith(v + nxt) else -1
                else:
                    j = text.find(v + nxt, start)
                if j < start:
                    continue
                e = j + len(v)
                if (text[e:] == nxt if last else text.startswith(nxt, e)) if strict else _common_prefix(nxt, text, e) > 0:
                    return e
            return -1

        end = locate(True)
        if end < 0 and exact:
            end = locate(False)
        if end < 0 and exact:  # unknown rewrite: the slot is whatever lies between this frame and the next
            if last:
                end = len(text) - len(nxt) if text.endswith(nxt) else -1
            elif nxt:
                end = text.find(nxt, start)
        if end < start:
            raise DraftsmithError(f"tokenizer {name}: cannot align the chat template's output with message {i} "
                                  f"({messages[i]['role']}); the template rewrites content in a way draftsmith does not "
                                  "know; use a template that renders content verbatim")
        if messages[i]["role"] == "assistant":
            spans.append((start, end))
        pos = end
    n_assistant = sum(m["role"] == "assistant" for m in messages)
    rendered = {slots[k][2] for k in range(len(slots)) if messages[slots[k][2]]["role"] == "assistant"}
    if n_assistant and not rendered:
        raise DraftsmithError(f"tokenizer {name}: its chat template renders no assistant content, so there is nothing to learn; "
                              "set a chat template that renders assistant turns (tokenizer_config.json `chat_template`)")
    if len(rendered) < n_assistant:
        missing = sorted(i for i, m in enumerate(messages) if m["role"] == "assistant" and i not in rendered)
        raise DraftsmithError(f"tokenizer {name}: its chat template drops assistant message(s) {missing}; "
                              "use a template that renders every assistant turn")
    return text, spans


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return ids


_MAX_TOKEN_CHARS: dict[int, int] = {}


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` covers (the longest vocab string: byte-level and
    sentencepiece tokens spell one character per byte or character they stand for)."""
    key = id(tokenizer)
    if key not in _MAX_TOKEN_CHARS:
        _MAX_TOKEN_CHARS[key] = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
    return _MAX_TOKEN_CHARS[key]


def render(tokenizer: Any, messages: Sequence[dict], max_length: int,
           answer_ids: Optional[Sequence[Optional[Sequence[int]]]] = None) -> Rendered:
    """Token ids, assistant-only loss mask and truncation flag of one conversation.

    `answer_ids` (regenerate): per assistant message, in order, the token ids the target generated
    for its content (None: tokenize its text). They replace the tokens of the re-encoded text, which
    can differ from what the model emitted (decode -> encode is not the identity), so a regenerated
    sample holds exactly the target's own tokens. A turn whose content boundaries fall inside a
    token of the rendered text (no clean cut) keeps its text's tokens and is counted in `unspliced`."""
    if not getattr(tokenizer, "is_fast", False):
        raise DraftsmithError(f"tokenizer {tokenizer_name(tokenizer)}: not a fast tokenizer (no offset mapping); "
                              "give the target folder a tokenizer.json (save it with a fast tokenizer class)")
    text, spans = content_spans(tokenizer, messages)
    limit = None if answer_ids is not None else (max_length + 2) * max_token_chars(tokenizer) + 64
    cut = limit is not None and len(text) > limit
    enc = tokenizer(text[:limit] if cut else text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    if cut and len(enc["input_ids"]) <= max_length:  # text the tokenizer dropped (normalizers): the bound did not hold
        cut = False
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    if cut:  # only the text that can reach the first max_length tokens is tokenized (a 1 MB message costs no more)
        spans = [(s, min(e, limit)) for s, e in spans if s < limit]
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    starts, ends = [a for a, _ in offsets], [b for _, b in offsets]
    special = _special_ids(tokenizer)
    mask = [0] * len(ids)
    eot_missing, n = 0, len(ids)
    token_spans = []
    for s, e in spans:
        t0 = bisect.bisect_right(ends, s)  # first token ending inside or after the span start
        while t0 > 0 and starts[t0 - 1] == ends[t0 - 1] == s:  # zero-width (trimmed) tokens at the start
            t0 -= 1
        t1 = max(bisect.bisect_left(starts, e), t0)  # first token starting at or after the span end
        mask[t0:t1] = [1] * (t1 - t0)
        clean = t1 == t0 or (starts[t0] >= s and ends[t1 - 1] <= e)  # no token straddles a content boundary
        token_spans.append((t0, t1, clean))
        if t1 < n and starts[t1] == e and ends[t1] > e and ids[t1] in special:
            mask[t1] = 1  # the end-of-turn token written right after the content
        else:
            eot_missing += 1
    unspliced, answer_starts = 0, [t0 for t0, _, _ in token_spans]
    if answer_ids is not None:
        if len(answer_ids) != len(token_spans):
            raise ValueError(f"answer_ids: {len(answer_ids)} answers for {len(token_spans)} assistant turns")
        out_ids, out_mask, prev, answer_starts = [], [], 0, []
        for (t0, t1, clean), new in zip(token_spans, answer_ids):
            if new is None or not clean:
                unspliced += new is not None
                new = ids[t0:t1]
            out_ids += ids[prev:t0]
            out_mask += mask[prev:t0]
            answer_starts.append(len(out_ids))
            out_ids += list(new)
            out_mask += [1] * len(new)
            prev = t1
        ids, mask = out_ids + ids[prev:], out_mask + mask[prev:]
    truncated = cut or len(ids) > max_length
    return Rendered(ids[:max_length], mask[:max_length], truncated, eot_missing, unspliced, answer_starts)


def prompt_ids(tokenizer: Any, messages: Sequence[dict],
               answer_ids: Optional[Sequence[Optional[Sequence[int]]]] = None) -> list[int]:
    """Token ids of the prompt for the next assistant answer: the chat template with the generation
    prompt, without added special tokens (as `render` counts them). With `answer_ids` (one per
    assistant message so far) the earlier answers are the target's own tokens, as `render` puts them
    in the finished sample, so the sample's prefix before each answer is exactly the prompt the target
    answered. Templates whose generation prompt is not an appendix to the plain rendering fall back
    to re-encoding the whole text."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    if answer_ids is not None and any(a is not None for a in answer_ids):
        base = apply_template(tokenizer, messages)
        if text.startswith(base):
            head = render(tokenizer, messages, 1 << 62, answer_ids).input_ids
            return head + tokenizer(text[len(base):], add_special_tokens=False)["input_ids"]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_with_mask(tokenizer: Any, messages: Sequence[dict], max_length: int) -> tuple[list[int], list[int], bool]:
    """(input_ids, loss_mask, truncated) of one conversation rendered with the tokenizer's chat template."""
    r = render(tokenizer, messages, max_length)
    return r.input_ids, r.loss_mask, r.truncated
