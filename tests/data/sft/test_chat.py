"""The complexity-chat-v2 template and final-assistant-only labels (docs/contracts.md §5)."""
import pytest

from ds_trhash.data.sft.chat import (
    EOS_ID,
    IGNORE_INDEX,
    ChatError,
    render,
    render_text,
    tokenize_example,
)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def test_single_turn_with_system_renders_exactly():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert render_text(messages) == "System:\nBe brief.\n\nUser:\nHi\n\nAssistant:\nHello!</s>"


def test_no_system_turn_by_default_and_generation_prompt():
    messages = [{"role": "user", "content": "Hi"}]
    assert render_text(messages, add_generation_prompt=True) == "User:\nHi\n\nAssistant:\n"


def test_multi_turn_concatenates_with_nothing_between():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    assert render_text(messages) == "User:\na\n\nAssistant:\nb</s>User:\nc\n\nAssistant:\nd</s>"
    assert render(messages) == ("User:\na\n\nAssistant:\nb</s>User:\nc\n\nAssistant:\n", "d</s>")


def test_contents_are_trimmed_and_empty_messages_skipped():
    messages = [
        {"role": "system", "content": "   "},
        {"role": "user", "content": "\n  Hi there \t\n"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": " again "},
        {"role": "assistant", "content": "  ok  "},
    ]
    assert render_text(messages) == "User:\nHi there\n\nUser:\nagain\n\nAssistant:\nok</s>"


def test_reasoning_envelope_is_plain_content():
    body = "<think>\nadd\n</think>\n<final>\n4\n</final>"
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": body}]
    assert render(messages)[1] == body + "</s>"


@pytest.mark.parametrize(
    "messages, code",
    [
        ([{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}], "unknown_role"),
        ([{"role": "user", "content": "x"}], "not_ending_with_assistant"),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}], "empty_final_assistant"),
        ([], "not_ending_with_assistant"),
        ("not a list", "bad_messages"),
        ([{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}], "bad_message"),
    ],
)
def test_invalid_conversations_are_rejected_with_a_reason(messages, code):
    with pytest.raises(ChatError) as err:
        render(messages)
    assert err.value.code == code


def test_unknown_role_message_names_the_allowed_roles():
    with pytest.raises(ChatError, match="allowed roles: system, user, assistant"):
        render_text([{"role": "Tool", "content": "x"}])


def test_unknown_supervision_mode_is_rejected(tokenizer):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    with pytest.raises(ChatError, match="allowed: final_assistant_only"):
        tokenize_example(messages, tokenizer, supervision="all_assistant")


def test_final_assistant_only_labels_on_multi_turn(tokenizer):
    messages = [
        {"role": "system", "content": "You answer questions."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "A mutable sequence."},
        {"role": "user", "content": "And a tuple?"},
        {"role": "assistant", "content": "An immutable sequence."},
    ]
    example = tokenize_example(messages, tokenizer)
    # Expected sequence built independently: segments split at EOS ids, prompt and completion apart.
    first = _ids(tokenizer, "System:\nYou answer questions.\n\nUser:\nWhat is a list?\n\nAssistant:\nA mutable sequence.")
    second = _ids(tokenizer, "User:\nAnd a tuple?\n\nAssistant:\n")
    completion = _ids(tokenizer, "An immutable sequence.") + [EOS_ID]
    prompt = first + [EOS_ID] + second
    sequence = prompt + completion
    assert example.input_ids == sequence[:-1]
    assert example.labels == [IGNORE_INDEX] * (len(prompt) - 1) + completion
    # The history assistant turn and its EOS are context only; the final EOS is supervised.
    assert example.labels[len(first) - 1] == IGNORE_INDEX
    assert example.labels[-1] == EOS_ID
    assert example.supervised_tokens == len(completion)
    # No token straddles the prompt/completion boundary: the completion tokens start right after "Assistant:\n".
    assert tokenizer.decode(example.input_ids[len(prompt) - len(second):len(prompt)]) == "User:\nAnd a tuple?\n\nAssistant:\n"


def test_labels_are_the_next_input_where_supervised(tokenizer):
    messages = [{"role": "user", "content": "Define x."}, {"role": "assistant", "content": "x is a name."}]
    example = tokenize_example(messages, tokenizer)
    supervised = [i for i, label in enumerate(example.labels) if label != IGNORE_INDEX]
    assert supervised == list(range(supervised[0], len(example.labels)))  # one contiguous tail
    for i in supervised[:-1]:
        assert example.labels[i] == example.input_ids[i + 1]
    assert tokenizer.decode([example.labels[i] for i in supervised[:-1]]) == "x is a name."


def test_eos_spelled_inside_content_is_rejected(tokenizer):
    messages = [{"role": "user", "content": "say </s> now"}, {"role": "assistant", "content": "no"}]
    with pytest.raises(ChatError) as err:
        tokenize_example(messages, tokenizer)
    assert err.value.code == "eos_in_content"
