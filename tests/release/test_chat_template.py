"""The export's Jinja chat template renders byte for byte what ds_trhash.data.sft.chat renders, and a
generation prompt tokenizes to exactly the prompt ids the SFT builder trained on."""
import jinja2
import pytest
from transformers import AutoTokenizer

from ds_trhash.data.sft.chat import IGNORE_INDEX, ChatError, render_text, tokenize_example
from ds_trhash.data.embedded import SYSTEM_PROMPT, demo_conversations


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_export):
    return AutoTokenizer.from_pretrained(tiny_export.out, trust_remote_code=True)


def _same(tok, messages, add_generation_prompt):
    ours = render_text(messages, add_generation_prompt=add_generation_prompt)
    theirs = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert theirs == ours, (messages, add_generation_prompt)


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


EDGE_CASES = [  # transformers refuses an empty conversation itself; the SFT builder never has one
    [_user("hi")],
    [{"role": "system", "content": "Be brief."}, _user("hi"), _assistant("hello")],
    [_user("q1"), _assistant("a1"), _user("q2"), _assistant("a2"), _user("q3")],
    [{"role": "system", "content": "   "}, _user("only whitespace system"), _assistant("ok")],
    [_user("\n\t "), _user("  padded both sides  "), _assistant("")],
    [_user("line one\nline two\n\n"), _assistant("\n\nindented:\n    code()\n")],
    [_user("naïve café — 中文 — emoji 🙂 — עברית"), _assistant("\u3000full-width space\xa0")],
    [_user("{{ messages }} {% if true %}x{% endif %} {# note #}"), _assistant("{{ raise_exception('no') }} {%- raw -%}")],
    [_user("a literal </s> in text and 'quotes' \"double\" \\ backslash"), _assistant("<s> <pad> <unk>")],
    [{"role": "system", "content": "s"}, {"role": "system", "content": "t"}, _assistant("starts with assistant")],
]


def test_every_demo_conversation_renders_identically(hf_tokenizer):
    conversations = demo_conversations()
    assert len(conversations) > 500 and any(len(c) == 5 for c in conversations)
    for messages in conversations:
        assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
        _same(hf_tokenizer, messages, add_generation_prompt=False)  # final assistant present
        _same(hf_tokenizer, messages[:-1], add_generation_prompt=True)  # final assistant to generate
        _same(hf_tokenizer, messages[1:-1], add_generation_prompt=True)  # no system turn


@pytest.mark.parametrize("messages", EDGE_CASES, ids=range(len(EDGE_CASES)))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_edge_cases_render_identically(hf_tokenizer, messages, add_generation_prompt):
    _same(hf_tokenizer, messages, add_generation_prompt)


def test_generation_prompt_tokenizes_like_the_sft_prompt(hf_tokenizer, tokenizer):
    for messages in demo_conversations()[::5]:
        example = tokenize_example(messages, tokenizer)
        prompt_len = next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX) + 1
        text = hf_tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == example.input_ids[:prompt_len]


@pytest.mark.parametrize("bad", [[{"role": "tool", "content": "x"}], [{"role": "user", "content": None}]])
def test_what_the_builder_refuses_the_template_refuses(hf_tokenizer, bad):
    with pytest.raises(ChatError):
        render_text(bad)
    with pytest.raises(jinja2.TemplateError):
        hf_tokenizer.apply_chat_template(bad, tokenize=False)


def test_tokenizer_files_carry_the_special_tokens(hf_tokenizer, tiny_export):
    tok = hf_tokenizer
    assert (tok.eos_token, tok.pad_token, tok.bos_token, tok.unk_token) == ("</s>", "<pad>", "<s>", "<unk>")
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.model_max_length == tiny_export.config.max_seq_len
    assert tok("User:\nhi", add_special_tokens=True)["input_ids"] == tok("User:\nhi", add_special_tokens=False)["input_ids"]


def test_a_message_with_an_extra_key_is_not_a_shape_the_builder_accepts():
    """Extra message keys are refused by the SFT builder (docs/sft_data.md), so no such conversation
    reaches training; the template, like transformers' own templates, renders role and content only."""
    with pytest.raises(ChatError, match="'name'"):
        render_text([{"role": "user", "content": "extra keys", "name": "x"}, _assistant("fine")])
