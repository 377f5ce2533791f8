"""The Hugging Face side of an export.

``configuration_tr_hash_moe.py`` and ``modeling_tr_hash_moe.py`` are copied verbatim into every
export (they import only torch and transformers, and load with ``trust_remote_code=True``);
``bundle.py`` writes the config, generation and tokenizer files beside them.
"""
