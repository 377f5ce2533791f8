"""Compile the model's dense parts with inductor, in place, so checkpoints keep their names.

``compile_model(model, mode)`` with mode ``none | layers | model``:

- ``layers``: every decoder layer is ``nn.Module.compile()``d (attention, norms, shared MLP,
  RoPE and the routed-expert custom op in one graph per layer; dynamo inlines the layer modules,
  so the layers share their compiled code rather than compiling once each);
- ``model``: the whole model, loss included, is compiled as one graph.

``Module.compile`` compiles the module's ``__call__`` in place: unlike ``torch.compile(model)``
it adds no wrapper, so ``state_dict()`` keys have no ``_orig_mod.`` prefix and DeepSpeed
checkpoints, exports and resume see the same names as an uncompiled run. The routed experts are
custom ops (``ds_trhash.model.experts``, ``kernels/routed_experts.py``), so nothing breaks the
graph; Liger's kernels, where chosen, are traced as user-defined Triton kernels and kept.
"""
from __future__ import annotations

from typing import Any

COMPILE_MODES = ("none", "layers", "model")


def compile_model(model: Any, mode: str) -> Any:
    """Compile `model` (a TRHashForCausalLM, possibly LoRA-adapted) in place; returns it."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; allowed: {list(COMPILE_MODES)}")
    if mode == "layers":
        for layer in model.layers:
            layer.compile()
    elif mode == "model":
        model.compile()
    model.compile_mode = mode
    return model
