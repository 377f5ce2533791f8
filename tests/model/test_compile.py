"""torch.compile sees the whole model: the routed experts are custom ops, nothing breaks the graph
but Liger's fused loss, which is kept out of it on purpose.

Dynamo's explain counts graph breaks of a decoder layer and of the whole model (loss, packed
document mask, PyTorch and Triton expert backends). The compiled-vs-eager comparison uses the
aot_eager backend: it traces through dynamo and AOTAutograd (fake implementations and the
registered backward of the expert ops included) without inductor's C++ build, which takes
minutes on a loaded 2-core machine; the engine launch test compiles with inductor.
"""
import os

import pytest
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM

ONE_LAYER = TRHashConfig.from_preset("tiny", num_layers=1)


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, ONE_LAYER.vocab_size, (2, 16), generator=gen)
    docs = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    positions = torch.cat([torch.arange(5), torch.arange(11)]).expand(2, 16)
    return {"input_ids": ids, "labels": ids.roll(-1, 1), "document_ids": docs, "position_ids": positions}


def make_model():
    torch.manual_seed(0)
    return TRHashForCausalLM(ONE_LAYER)


def breaks(fn, *args, **kwargs):
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    return explanation.graph_break_count, [b.reason for b in explanation.break_reasons]



def assert_same_grads(compiled, eager, rtol: float, atol: float) -> None:
    """Every parameter's gradient of the compiled model equals the eager one's, by name."""
    grads = dict(compiled.named_parameters())
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=rtol, atol=atol, msg=name)

def test_decoder_layer_and_model_trace_without_graph_breaks(batch):
    model = make_model()
    assert breaks(model, **batch) == (0, [])
    layer = model.layers[0]
    x = torch.randn(2, 16, ONE_LAYER.hidden_size)
    assert breaks(layer, x, batch["input_ids"], batch["position_ids"], None) == (0, [])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton experts run on CUDA or under TRITON_INTERPRET=1")
def test_triton_experts_trace_without_graph_breaks(batch):
    model = make_model()
    model.set_backends(experts="triton")
    assert breaks(model, batch["input_ids"], labels=batch["labels"]) == (0, [])
    assert model.backends_used()["experts"] == "triton"


def test_compiled_model_matches_eager_forward_and_gradients(batch):
    eager = make_model()
    compiled_model = make_model()
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    loss_eager = eager(**batch)
    loss_compiled = compiled(**batch)
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-5, atol=1e-6)
    loss_eager.backward()
    loss_compiled.backward()
    assert_same_grads(compiled_model, eager, rtol=1e-4, atol=1e-6)
    assert compiled_model.layers[0].mlp.engine.expert_gate.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ["layers", "model"])
def test_compiling_in_place_keeps_state_dict_names(mode):
    from ds_trhash.model.compile import compile_model

    plain = make_model().state_dict()
    model = compile_model(make_model(), mode)
    assert list(model.state_dict()) == list(plain)  # no "_orig_mod." anywhere
    assert all(torch.equal(v, plain[k]) for k, v in model.state_dict().items())
    compiled = model.layers if mode == "layers" else [model]
    assert all(m._compiled_call_impl is not None for m in compiled)
    assert model.backends_used()["compile"] == mode
    with pytest.raises(ValueError, match="unknown compile mode 'all'"):
        compile_model(make_model(), "all")


@pytest.mark.gpu
def test_inductor_compiled_model_with_triton_experts_matches_eager_on_cuda(batch):
    """On a GPU: inductor, fullgraph, bf16, Triton experts and flex attention for the packed rows."""
    from ds_trhash.model.compile import compile_model

    eager, compiled = make_model().cuda().bfloat16(), make_model().cuda().bfloat16()
    for m in (eager, compiled):
        m.set_backends(experts="triton")
    compile_model(compiled, "model")
    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    loss_eager, loss_compiled = eager(**cuda_batch), compiled(**cuda_batch)
    torch.testing.assert_close(loss_compiled.float(), loss_eager.float(), rtol=2e-2, atol=2e-2)
    loss_eager.backward()
    loss_compiled.backward()
    grads = dict(compiled.named_parameters())
    for name, p in eager.named_parameters():
        err = (grads[name].grad.float() - p.grad.float()).norm() / p.grad.float().norm().clamp(min=1e-12)
        assert err < 5e-2, name
    assert compiled.backends_used()["experts"] == "triton"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Liger runs on CUDA or under TRITON_INTERPRET=1")
def test_a_compiled_model_runs_the_liger_loss_outside_its_graph_and_matches_eager(batch, monkeypatch):
    """kernels.compile model with the Liger loss: dynamo never traces Liger's fused linear CE (its
    .item() broke the graph inside the function and tracing resumed in the middle of it; on a GPU
    that gave non-finite gradients). The loss, with ignored labels, and the gradients are eager's."""
    import liger_kernel.transformers.functional as liger

    calls = []
    fused = liger.liger_fused_linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(torch.compiler.is_compiling())
        return fused(*args, **kwargs)

    monkeypatch.setattr(liger, "liger_fused_linear_cross_entropy", spy)
    config = TRHashConfig.from_preset("tiny", num_layers=1, vocab_size=512)  # the interpreter's CE is slow in V
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = (batch["input_ids"] % config.vocab_size).to(device)
    labels = ids.roll(-1, 1)
    labels[0, :6] = -100  # a prompt and the last position: ignored targets
    labels[:, -1] = -100
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(TRHashForCausalLM(config).to(device))
        models[-1].set_backends(loss="liger")
    eager, compiled = models
    torch._dynamo.reset()
    compiled.compile(backend="aot_eager")  # what compile_model("model") does, without inductor's C++ build
    loss_eager = eager(ids, labels=labels)
    loss_compiled = compiled(ids, labels=labels)
    assert calls == [False, False]  # once each, and never while dynamo traced
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-6, atol=1e-6)
    loss_eager.backward()
    loss_compiled.backward()
    assert_same_grads(compiled, eager, rtol=1e-5, atol=1e-7)
    assert compiled.backends_used()["loss"] == "liger"


def test_expert_load_counting_stays_in_the_graph_and_counts_under_compile(batch):
    """The trainer always counts routes (expert_load.csv): with counting on, the model still
    traces as one graph, and a compiled training forward leaves the same counts as eager."""
    model = make_model()
    model.track_expert_load = True
    assert breaks(model, **batch) == (0, [])
    model.take_expert_load()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(batch["input_ids"], labels=batch["labels"]).backward()
    counts = model.take_expert_load()
    flat = batch["input_ids"].reshape(-1)
    expected = torch.stack([torch.bincount(e.route_table[:, flat].reshape(-1), minlength=ONE_LAYER.num_experts)
                            for e in model.engines()])
    assert counts is not None and torch.equal(counts, expected)
