"""Golden assistant-only loss masks for real chat templates (Llama-3.1, Qwen2.5, Qwen3, DeepSeek-V3, draftsmith's own),
rendered with tiny tokenizers that carry each family's special tokens; plus property tests of the mask builder."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftsmith.messages import DraftsmithError
from draftsmith.data.template import content_spans, render, render_with_mask
from draftsmith.testing import CHAT_TEMPLATE, SPECIAL_TOKENS

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
TEXTS = ["Hello, who are you? Hi there! I am a bot.", "What is 2+2? 2+2 is 4.", "You are a helpful assistant.",
         "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024", "The answer is 4. reasoning think",
         "system user assistant You are Qwen, created by Alibaba Cloud."] * 3


def make_tokenizer(name: str, template: str, specials: list[str], bos: str | None, eos: str, pad: str | None = None,
                   added: tuple[str, ...] = (), bos_post_processor: bool = False):
    """A byte-level BPE tokenizer with the given special tokens and chat template (in memory)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer=trainer)
    tok.add_tokens([AddedToken(a, special=False, normalized=False) for a in added])
    if bos_post_processor:  # like Llama-3: encode() prepends BOS unless add_special_tokens=False
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)
    fast.name_or_path = name
    fast.chat_template = template
    return fast


def llama3():
    return make_tokenizer("tiny-llama-3.1", (TEMPLATES / "llama3_1.jinja").read_text(),
                          ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>",
                          bos_post_processor=True)


def qwen25():
    return make_tokenizer("tiny-qwen2.5", (TEMPLATES / "qwen2_5.jinja").read_text(),
                          ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", pad="<|endoftext|>")


def deepseek_v3():
    return make_tokenizer("tiny-deepseek-v3", (TEMPLATES / "deepseek_v3.jinja").read_text(),
                          ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"], "<｜begin▁of▁sentence｜>",
                          "<｜end▁of▁sentence｜>", pad="<｜▁pad▁｜>", added=("<｜User｜>", "<｜Assistant｜>"))


def qwen3():
    return make_tokenizer("tiny-qwen3", (TEMPLATES / "qwen3.jinja").read_text(),
                          ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", pad="<|endoftext|>",
                          added=("<think>", "</think>"))


def draftsmith_tok():
    return make_tokenizer("tiny-draftsmith", CHAT_TEMPLATE, SPECIAL_TOKENS, "<|bos|>", "<|end|>", pad="<|pad|>")


TOKENIZERS = {"llama3": llama3(), "qwen25": qwen25(), "qwen3": qwen3(), "deepseek_v3": deepseek_v3(),
              "draftsmith": draftsmith_tok()}

CONV = [{"role": "user", "content": "Hello, who are you?"},
        {"role": "assistant", "content": "Hi there! I am a bot."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 is 4."}]


def masked_runs(tok, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded text of each contiguous run of loss tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]


def unmasked_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False, clean_up_tokenization_spaces=False)


# ----------------------------------------------------------------------------- golden masks


def test_llama3_golden():
    tok = TOKENIZERS["llama3"]
    conv = [{"role": "system", "content": "You are a helpful assistant."}] + CONV[:3] + [
        {"role": "assistant", "content": "  2+2 is 4.\n"}]  # the template trims content
    ids, mask, truncated = render_with_mask(tok, conv, 4096)
    assert not truncated
    assert masked_runs(tok, ids, mask) == ["Hi there! I am a bot.<|eot_id|>", "2+2 is 4.<|eot_id|>"]
    assert unmasked_text(tok, ids, mask) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello, who are you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids.count(tok.bos_token_id) == 1  # BOS from the template only, not again from the post-processor


def test_qwen25_golden_default_system_prompt():
    tok = TOKENIZERS["qwen25"]
    ids, mask, _ = render_with_mask(tok, CONV, 4096)
    assert masked_runs(tok, ids, mask) == ["Hi there! I am a bot.<|im_end|>", "2+2 is 4.<|im_end|>"]
    assert unmasked_text(tok, ids, mask) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello, who are you?<|im_end|>\n<|im_start|>assistant\n\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n\n")


def test_qwen25_golden_own_system_prompt():
    tok = TOKENIZERS["qwen25"]
    conv = [{"role": "system", "content": "You are a pirate."}] + CONV[:2]
    ids, mask, _ = render_with_mask(tok, conv, 4096)
    assert masked_runs(tok, ids, mask) == ["Hi there! I am a bot.<|im_end|>"]
    text = unmasked_text(tok, ids, mask)
    assert text.startswith("<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\n") and "Qwen" not in text


def test_deepseek_v3_golden():
    tok = TOKENIZERS["deepseek_v3"]
    conv = [{"role": "system", "content": "You are a helpful assistant."}] + CONV
    ids, mask, _ = render_with_mask(tok, conv, 4096)
    assert masked_runs(tok, ids, mask) == ["Hi there! I am a bot.<｜end▁of▁sentence｜>", "2+2 is 4.<｜end▁of▁sentence｜>"]
    assert unmasked_text(tok, ids, mask) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello, who are you?<｜Assistant｜>"
        "<｜User｜>What is 2+2?<｜Assistant｜>")


def test_deepseek_v3_drops_reasoning_and_mask_follows():
    tok = TOKENIZERS["deepseek_v3"]
    conv = CONV[:1] + [{"role": "assistant", "content": "<think>\nreasoning\n</think>\n\nThe answer is 4."}]
    ids, mask, _ = render_with_mask(tok, conv, 4096)
    # the template keeps what follows </think>, newlines included; that is what the model is trained on
    assert masked_runs(tok, ids, mask) == ["\n\nThe answer is 4.<｜end▁of▁sentence｜>"]


def test_qwen3_reasoning_golden():
    # Qwen3 drops the reasoning of turns before the last user message and renders the last turn's reasoning
    # inside <think>; the frames then differ from the placeholder render, and the mask starts where they diverge
    tok = TOKENIZERS["qwen3"]
    conv = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n2+2 is 4."},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "<think>\nbe polite\n</think>\n\nYou are welcome."}]
    ids, mask, _ = render_with_mask(tok, conv, 4096)
    assert masked_runs(tok, ids, mask) == ["2+2 is 4.<|im_end|>", "be polite\n</think>\n\nYou are welcome.<|im_end|>"]
    assert unmasked_text(tok, ids, mask) == ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n\n"
                                             "<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n<think>\n\n")


def test_draftsmith_template_golden():
    tok = TOKENIZERS["draftsmith"]
    ids, mask, _ = render_with_mask(tok, CONV, 4096)
    assert masked_runs(tok, ids, mask) == ["Hi there! I am a bot.<|end|>", "2+2 is 4.<|end|>"]
    assert unmasked_text(tok, ids, mask) == ("<|bos|><|user|>\nHello, who are you?<|end|>\n<|assistant|>\n\n"
                                             "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n\n")


def test_assistant_text_inside_headers_and_user_turns_is_not_masked():
    # "assistant" and "Hi" occur in headers and the user turn before the reply; only the reply is masked
    tok = TOKENIZERS["qwen25"]
    conv = [{"role": "user", "content": "Say Hi"}, {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": "assistant"}, {"role": "assistant", "content": "assistant"}]
    ids, mask, _ = render_with_mask(tok, conv, 4096)
    assert masked_runs(tok, ids, mask) == ["Hi<|im_end|>", "assistant<|im_end|>"]


def test_truncation():
    tok = TOKENIZERS["draftsmith"]
    full, _, _ = render_with_mask(tok, CONV, 4096)
    ids, mask, truncated = render_with_mask(tok, CONV, 10)
    assert truncated and ids == full[:10] and len(mask) == 10
    assert not render_with_mask(tok, CONV, len(full))[2]


def test_template_without_assistant_content_is_an_error():
    tok = make_tokenizer("user-only-template", "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}",
                         SPECIAL_TOKENS, "<|bos|>", "<|end|>")
    with pytest.raises(DraftsmithError, match="user-only-template: its chat template renders no assistant content"):
        render(tok, CONV, 100)


def test_tokenizer_without_template_is_an_error():
    tok = make_tokenizer("no-template", "", SPECIAL_TOKENS, "<|bos|>", "<|end|>")
    tok.chat_template = None
    with pytest.raises(DraftsmithError, match="no-template: has no chat template"):
        render(tok, CONV, 100)


def test_template_exception_is_a_one_line_error():
    tok = make_tokenizer("strict", "{{ raise_exception('Conversation roles must alternate') }}", SPECIAL_TOKENS, "<|bos|>", "<|end|>")
    with pytest.raises(DraftsmithError, match="strict: chat template failed .*roles must alternate") as e:
        render(tok, CONV, 100)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- properties

PIECES = ["Hi", "there", " ", "  ", "!", "2+2", "\n", "\t", "é", "漢字", "🙂", "<|end|>", "<|im_end|>", "<|user|>",
          "assistant", "user", "<", "|", ">", "'s", "x y", "{{", "}}", "%"]
content = st.lists(st.sampled_from(PIECES), min_size=1, max_size=8).map("".join).map(str.strip).filter(bool)
conversation = st.lists(st.tuples(content, content), min_size=1, max_size=3).map(
    lambda pairs: [m for u, a in pairs for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})])
EOT = {"llama3": "<|eot_id|>", "qwen25": "<|im_end|>", "qwen3": "<|im_end|>", "draftsmith": "<|end|>", "deepseek_v3": "<｜end▁of▁sentence｜>"}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(TOKENIZERS)), messages=conversation)
def test_mask_is_exactly_assistant_contents_plus_eot(name, messages):
    tok = TOKENIZERS[name]
    ids, mask, truncated = render_with_mask(tok, messages, 100_000)
    assert not truncated and len(ids) == len(mask)
    expected = [m["content"] + EOT[name] for m in messages if m["role"] == "assistant"]
    assert "".join(masked_runs(tok, ids, mask)) == "".join(expected)
    # every loss token lies inside an assistant span or is the token right after one
    text, spans = content_spans(tok, messages)
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    for t, m in enumerate(mask):
        if m:
            a, b = offsets[t]
            assert any(a < e and b > s for s, e in spans) or any(a == e for _, e in spans), (text, a, b)
