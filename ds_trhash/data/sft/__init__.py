"""Instruction-tuning sets: the chat template and final-turn supervision, `sft build` (audited,
tokenized, fail-closed manifest), and the packed per-rank SFT batches. Imports ``formats`` (tokenizer).
"""
