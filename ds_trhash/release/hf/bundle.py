"""Write the files that make an export a Hugging Face model directory.

Beside ``model.safetensors``: ``config.json`` (model_type ``tr_hash_moe``, the published field
names, ``auto_map`` to the two code files), the code files themselves, ``generation_config.json``
and, when the export carries ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` whose ``chat_template`` renders the complexity-chat-v2 format. The
JSON is written here rather than by transformers' ``save_pretrained`` so that its bytes (and so
the export manifest's hashes) do not depend on the installed transformers release.
"""
from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ds_trhash.data.formats.tokenizer import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN, PAD_ID, PAD_TOKEN, UNK_TOKEN
from ds_trhash.io import write_json
from ds_trhash.model.config import HF_MODEL_TYPE, TRHashConfig

HERE = Path(__file__).resolve().parent
CONFIGURATION_FILE = "configuration_tr_hash_moe.py"
MODELING_FILE = "modeling_tr_hash_moe.py"
CODE_FILES = (CONFIGURATION_FILE, MODELING_FILE)
ARCHITECTURE = "TRHashForCausalLM"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN}
SPECIAL_IDS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def hf_config(model_config: Mapping[str, Any], dtype: str = "float32") -> dict[str, Any]:
    """The config.json of an export of a model with this (to_dict) config."""
    cfg = TRHashConfig.from_dict(dict(model_config))
    return {
        "model_type": HF_MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "auto_map": {"AutoConfig": f"{CONFIGURATION_FILE[:-3]}.TRHashConfig",
                     "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.{ARCHITECTURE}"},
        **cfg.to_hf_fields(),
        "attention_type": "gqa",
        "mlp_type": "tr_hash_engine",
        **SPECIAL_IDS,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def write_model_files(dest: Path, model_config: Mapping[str, Any], dtype: str) -> None:
    """config.json, generation_config.json and the two code files."""
    write_json(dest / "config.json", hf_config(model_config, dtype), fsync=False)
    write_json(dest / GENERATION_CONFIG, {**SPECIAL_IDS, "do_sample": False}, fsync=False)
    for name in CODE_FILES:
        shutil.copyfile(HERE / name, dest / name)


def write_tokenizer_files(dest: Path, chat_template: str, model_max_length: int) -> None:
    """tokenizer_config.json and special_tokens_map.json for the tokenizer.json already in dest;
    the chat template also goes to chat_template.jinja (where transformers 5 saves it)."""
    write_json(dest / TOKENIZER_CONFIG, {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **SPECIAL_TOKENS,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",  # decoder-only batches generate from the right edge
    }, fsync=False)
    write_json(dest / SPECIAL_TOKENS_MAP, SPECIAL_TOKENS, fsync=False)


def write_chat_template(dest: Path, chat_template: str) -> None:
    (dest / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
