"""Compile the model's dense parts with inductor, in place, so checkpoints keep their names.

``compile_model(model, mode)`` with mode ``none | layers | model``:

- ``layers``: every decoder layer is ``nn.Module.compile()``d (attention, norms, shared MLP,
  RoPE and the routed-expert custom op in one graph per layer; dynamo inlines the layer modules,
  so the layers share their compiled code rather than compiling once each);
- ``model``: the whole model is compiled as one graph, the head loss included when it is the
  chunked or plain one. Liger's fused linear cross entropy is never traced
  (``torch.compiler.disable`` on ``loss.liger_ce``, ``loss.keep_liger_outside_graph``): its ``.item()`` broke the graph inside the
  function and dynamo resumed tracing in the middle of its in-place gradient writes, which on a
  GPU gave non-finite gradients and then an illegal memory access. With it the graph breaks
  once, at the loss, which then runs as in eager mode.

``Module.compile`` compiles the module's ``__call__`` in place: unlike ``torch.compile(model)``
it adds no wrapper, so ``state_dict()`` keys have no ``_orig_mod.`` prefix and DeepSpeed
checkpoints, exports and resume see the same names as an uncompiled run. The routed experts are
custom ops (``ds_trhash.model.experts``, ``kernels/routed_experts.py``), so nothing breaks the
graph; Liger's RMSNorm and RoPE, where chosen, are traced as user-defined Triton kernels and kept.
"""
from __future__ import annotations

from ds_trhash.model.loss import keep_liger_outside_graph
from ds_trhash.model.transformer import TRHashForCausalLM

COMPILE_MODES = ("none", "layers", "model")


def compile_model(model: TRHashForCausalLM, mode: str) -> TRHashForCausalLM:
    """Compile `model` (a TRHashForCausalLM, possibly LoRA-adapted) in place; returns it."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; allowed: {list(COMPILE_MODES)}")
    if mode != "none":
        keep_liger_outside_graph()  # the wrapper made before dynamo traces the loss
    if mode == "layers":
        for layer in model.layers:
            layer.compile()
    elif mode == "model":
        model.compile()
    model.compile_mode = mode
    return model
