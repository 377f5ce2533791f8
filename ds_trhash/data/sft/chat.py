"""The `complexity-chat-v2` chat template and final-assistant-only supervision (docs/contracts.md §5).

The template is reproduced byte for byte because a model fine-tuned on one spelling and
prompted with another silently degrades. The EOS that ends an assistant turn is a token id
(0), never the text "</s>": it is inserted between separately tokenized text segments, so a
tokenizer that would merge characters across the turn boundary cannot shift it.

History assistant turns are rendered as "Assistant:\\n{content}" followed by an EOS id, like
every assistant turn, and are masked (context only); only the final assistant turn and its
EOS are supervised. Reasoning data uses the release's optional envelope
("<think>\\n…\\n</think>\\n<final>\\n…\\n</final>") as plain assistant content: it is passed
through unchanged and supervised like any other completion text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from ds_trhash.errors import UserError
from ds_trhash.model.loss import IGNORE_INDEX  # re-exported: the data layer writes it into labels

if TYPE_CHECKING:
    from tokenizers import Encoding

CHAT_TEMPLATE_ID = "complexity-chat-v2"
EOS_TOKEN = "</s>"
EOS_ID = 0
PAD_TOKEN = "<pad>"
PAD_ID = 1
GENERATION_PROMPT = "Assistant:\n"
DEFAULT_SYSTEM_PROMPT = ""
SUPERVISION_MODES = ("final_assistant_only",)

# Per role: the text before and after the trimmed content. An assistant turn is closed by
# the EOS id instead of text.
_TURN_FORMAT = {
    "system": ("System:\n", "\n\n"),
    "user": ("User:\n", "\n\n"),
    "assistant": (GENERATION_PROMPT, ""),
}
ROLES = tuple(_TURN_FORMAT)
MESSAGE_KEYS = ("role", "content")

# A JSON description of the template, copied beside built sets and exports so that inference
# code can reproduce the exact prompt format without importing this module.
TEMPLATE_DESCRIPTION: dict[str, Any] = {
    "id": CHAT_TEMPLATE_ID,
    "turns": {role: {"prefix": pre, "suffix": post} for role, (pre, post) in _TURN_FORMAT.items()},
    "assistant_turn_end": {"token": EOS_TOKEN, "id": EOS_ID},
    "turn_separator": "",
    "content": "trimmed; a message whose trimmed content is empty is skipped",
    "default_system_prompt": DEFAULT_SYSTEM_PROMPT,
    "generation_prompt": GENERATION_PROMPT,
    "reasoning_envelope": "<think>\n...\n</think>\n<final>\n...\n</final> (optional, plain content)",
    "supervision": SUPERVISION_MODES[0],
}

# The same template as Jinja, for Hugging Face tokenizers (an export's tokenizer_config.json):
# `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` renders exactly
# what render_text does (tests hold the two byte-identical). Jinja's `trim` is Python's
# str.strip, as in normalize(); every tag strips its surrounding whitespace, so the template's
# own layout never reaches the output. `eos_token` is the tokenizer's ("</s>").
CHAT_TEMPLATE_JINJA = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unknown role ' ~ message['role'] ~ '; allowed roles: system, user, assistant') -}}"
    "{%- endif -%}"
    "{%- if message['content'] is not string -%}"
    "{{- raise_exception('message content must be a string') -}}"
    "{%- endif -%}"
    "{%- set content = message['content'] | trim -%}"
    "{%- if content -%}"
    "{%- if message['role'] == 'system' -%}{{- 'System:\\n' + content + '\\n\\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- 'User:\\n' + content + '\\n\\n' -}}"
    "{%- else -%}{{- 'Assistant:\\n' + content + eos_token -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:\\n' -}}{%- endif -%}"
)


class ChatError(UserError, ValueError):
    """A conversation the template cannot render or supervise.

    `code` is a stable short reason (used to count dropped examples); the message says what
    is wrong and how to fix it.
    """

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Encoder(Protocol):
    """What is needed from a tokenizer: `tokenizers.Tokenizer` satisfies it."""

    def encode(self, sequence: str, *, add_special_tokens: bool = ...) -> Encoding: ...


@dataclass(frozen=True)
class Turn:
    role: str
    content: str  # trimmed, non-empty


@dataclass(frozen=True)
class Example:
    """One tokenized conversation, pre-shifted: `labels[i]` is the target after `input_ids[i]`."""

    input_ids: list[int]
    labels: list[int]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(f"input_ids ({len(self.input_ids)}) and labels ({len(self.labels)}) differ in length")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def supervised_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


def check_supervision(mode: str) -> str:
    if mode not in SUPERVISION_MODES:
        raise ChatError("unknown_supervision", f"unknown supervision mode {mode!r}; allowed: {', '.join(SUPERVISION_MODES)}")
    return mode


def normalize(messages: object) -> list[Turn]:
    """Validate roles and content types, trim, and drop empty messages."""
    if not isinstance(messages, list):
        raise ChatError("bad_messages", f"'messages' must be a list of {{role, content}} objects, got {type(messages).__name__}")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatError("bad_message", f"message {i} must be an object with 'role' and 'content', got {type(message).__name__}")
        extra = sorted(str(key) for key in message if key not in MESSAGE_KEYS)
        if extra:
            # Refused, not ignored: a key such as "name" or "tool_calls" carries meaning the
            # template would silently drop.
            raise ChatError("unknown_message_key", f"message {i} has key(s) {', '.join(map(repr, extra))}; a message "
                                                   f"holds only {' and '.join(MESSAGE_KEYS)}")
        role, content = message.get("role"), message.get("content")
        if role not in _TURN_FORMAT:
            raise ChatError("unknown_role", f"message {i} has unknown role {role!r}; allowed roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ChatError("bad_message", f"message {i} ({role}) content must be a string, got {type(content).__name__}")
        content = content.strip()
        if content:
            turns.append(Turn(role, content))
    return turns


def _turn_text(turn: Turn) -> str:
    prefix, suffix = _TURN_FORMAT[turn.role]
    return prefix + turn.content + suffix


def render_text(messages: object, add_generation_prompt: bool = False) -> str:
    """The whole conversation as text, with "</s>" spelled where the EOS id goes (display, tests)."""
    parts = []
    for turn in normalize(messages):
        parts.append(_turn_text(turn))
        if turn.role == "assistant":
            parts.append(EOS_TOKEN)
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return "".join(parts)


def split_final(messages: object) -> tuple[list[Turn], Turn]:
    """The history and the final assistant turn; a conversation without one cannot be supervised."""
    turns = normalize(messages)
    if turns and turns[-1].role == "assistant":
        return turns[:-1], turns[-1]
    last = messages[-1] if isinstance(messages, Sequence) and messages else None
    if isinstance(last, Mapping) and last.get("role") == "assistant":
        raise ChatError("empty_final_assistant", "the final assistant message is empty after trimming; give it content or drop the conversation")
    ending = f"a {turns[-1].role} turn" if turns else "no non-empty message"
    raise ChatError("not_ending_with_assistant", f"the conversation ends with {ending}; it must end with a non-empty assistant turn")


def render(messages: object) -> tuple[str, str]:
    """(prompt_text, completion_text) with "</s>" spelled for EOS, for display and audits."""
    history, final = split_final(messages)
    prompt = render_text([{"role": t.role, "content": t.content} for t in history]) + GENERATION_PROMPT
    return prompt, final.content + EOS_TOKEN


def _encode(tokenizer: Encoder, text: str) -> list[int]:
    if not text:
        return []
    ids = list(tokenizer.encode(text, add_special_tokens=False).ids)
    if EOS_ID in ids:
        raise ChatError("eos_in_content", f"the text {text[:60]!r}... tokenizes to the EOS id {EOS_ID} (it spells {EOS_TOKEN!r}); remove that spelling from the content")
    return ids


def _segments_to_ids(tokenizer: Encoder, turns: Sequence[Turn], tail: str) -> list[int]:
    """Tokenize the text between EOS ids as one string each, then insert the EOS ids."""
    ids: list[int] = []
    pending = ""
    for turn in turns:
        pending += _turn_text(turn)
        if turn.role == "assistant":
            ids += _encode(tokenizer, pending) + [EOS_ID]
            pending = ""
    return ids + _encode(tokenizer, pending + tail)


def tokenize_example(messages: object, tokenizer: Encoder, supervision: str = "final_assistant_only") -> Example:
    """Prompt and completion tokenized separately and concatenated, then shifted by one.

    For the full sequence s = prompt + completion + [EOS]: input_ids = s[:-1] and
    labels = s[1:] with -100 wherever the target is a prompt token, so exactly the
    completion tokens and the final EOS are supervised.
    """
    check_supervision(supervision)
    history, final = split_final(messages)
    prompt = _segments_to_ids(tokenizer, history, GENERATION_PROMPT)
    completion = _encode(tokenizer, final.content) + [EOS_ID]
    sequence = prompt + completion
    labels = [IGNORE_INDEX] * (len(prompt) - 1) + completion
    return Example(input_ids=sequence[:-1], labels=labels)
