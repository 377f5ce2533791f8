"""The training paths bench_step.py times: each ``build_*`` returns (step, info), where ``step()``
runs one optimizer step (``--grad-accum`` micro-batches) and returns the loss as a device tensor.

Every case starts from the same seeded model and the same fixed batch; ``holder`` keeps what the
case allocated, so the caller can free it. The cases' definitions are in bench_step.py's docstring.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ds_trhash.model.loss import IGNORE_INDEX


# Every case steps at the config's peak learning rate: the plain loops (compile_masked, eager,
# compile, manual) run a constant rate, so the engine's scheduler is made constant too (no warmup,
# a floor of 1.0), and the cases' losses on the repeated batch compare like for like. (The
# 200m config's warmup over 1B tokens, capped at the case's few steps, kept the engine below
# the plain loops' rate at every step of the first GPU run.)
CONSTANT_LR = ("schedule.kind=cosine", "schedule.warmup_tokens=null", "schedule.warmup_fraction=0",
               "schedule.min_warmup_steps=0", "schedule.floor=1.0")


class Ctx:
    """What every case shares: arguments, device, dtype, model config, one fixed batch."""

    def __init__(self, args, device: torch.device):
        from ds_trhash.model.config import TRHashConfig
        from ds_trhash.training import config as tcfg

        self.args = args
        self.device = device
        self.dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        overrides = [f"model.preset={args.preset}", f"data.seq_len={args.seq_len}",
                     f"batch.micro_batch={args.micro_batch}", f"batch.grad_accum={args.grad_accum}",
                     "batch.global_tokens=null", f"zero.stage={args.zero}", f"precision={args.precision}",
                     *CONSTANT_LR]
        if args.kernels_policy:
            overrides.append(f"kernels.policy={args.kernels_policy}")
        if args.activation_checkpointing:
            overrides.append(f"model.activation_checkpointing={args.activation_checkpointing}")
        self.train_cfg = tcfg.load_config(args.config, overrides + list(args.set))
        self.ds_config = tcfg.to_deepspeed_dict(self.train_cfg, 1)
        # As the trainer builds it: the preset, with the loss chunk size of the config.
        self.model_cfg = dataclasses.replace(TRHashConfig.from_preset(args.preset),
                                             loss_chunk_tokens=self.train_cfg.kernels.loss_chunk_tokens)
        if args.seq_len > self.model_cfg.max_seq_len:
            raise SystemExit(f"--seq-len {args.seq_len} exceeds the {args.preset} context "
                             f"{self.model_cfg.max_seq_len}")
        gen = torch.Generator(device="cpu").manual_seed(1234)
        ids = torch.randint(0, self.model_cfg.vocab_size, (args.micro_batch, args.seq_len), generator=gen)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, :-1] = ids[:, 1:]  # next-token targets, the last position unsupervised
        self.cpu_batch = {"input_ids": ids, "labels": labels}  # what the trainer's loop receives
        self.ids, self.labels = ids.to(device), labels.to(device)
        self.grad_accum = args.grad_accum

    def new_model(self):
        """A fresh model on CPU with the run's seed (the trainer's build order), default backends,
        and the config's activation checkpointing, set as the trainer sets it."""
        from ds_trhash.model import TRHashForCausalLM

        torch.manual_seed(self.train_cfg.seed)
        model = TRHashForCausalLM(self.model_cfg)
        m = self.train_cfg.model
        model.set_activation_checkpointing(m.activation_checkpointing, m.activation_checkpointing_every)
        return model

    def kernel_choice(self):
        """The trainer's kernels (``plan.kernel_choice``: the policy resolved, every fused kernel
        checked once against PyTorch, the experts backend measured for this shape on CUDA) under
        the trainer's ``training.deterministic`` setting; for the cases that stand for the trainer
        (engine*, and manual, its like-for-like baseline). Each case runs in a process of its
        own, so the deterministic mode set here reaches no other case."""
        from ds_trhash.training.determinism import use_deterministic_kernels
        from ds_trhash.training.preparation.plan import kernel_choice

        use_deterministic_kernels(self.train_cfg.training.deterministic)
        return kernel_choice(self.train_cfg, self.model_cfg, self.device)


def checkpointed(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if getattr(layer, "checkpointed", False)]


def _adamw(groups, opt_cfg, device: torch.device) -> torch.optim.AdamW:
    kwargs = dict(lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps)
    if device.type == "cuda":
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    return torch.optim.AdamW(groups, **kwargs)


def _accumulate(ctx: Ctx, forward):
    """grad_accum forwards and backwards of the fixed batch, each loss divided by grad_accum;
    returns the step's mean loss (detached)."""
    total = None
    for _ in range(ctx.grad_accum):
        loss = forward(ctx.ids, ctx.labels) / ctx.grad_accum
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


# ----------------------------------------------------------------------------- plain PyTorch


def masked_experts(x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor, weights) -> torch.Tensor:
    """Every expert on every token, weighted by the route mask: x [N, H], routes [K, N],
    gate/up [E, H, W], down [E, W, H] -> [N, H]. Dense, static shapes: what inductor fuses."""
    out = None
    for e in range(gate.shape[0]):
        y = (F.silu(x @ gate[e]) * (x @ up[e])) @ down[e]  # expert e on all N tokens: [N, H]
        mask = sum(w * (routes[k] == e) for k, w in enumerate(weights))  # [N] route weight of e
        y = y * mask.to(y.dtype)[:, None]
        out = y if out is None else out + y
    return out


def _masked_engine_class():
    from ds_trhash.model.decoder import TRHashMoEEngine

    class MaskedExperts(TRHashMoEEngine):
        """The MoE block with its routed experts computed masked (bench only)."""

        def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
            c = self.config
            routes = self.route_table[:, token_ids.clamp(0, c.vocab_size - 1)]  # [K, N]
            shared = self.shared_down(F.silu(self.shared_gate(x)) * self.shared_up(x))
            routed = masked_experts(x, routes, self.expert_gate, self.expert_up, self.expert_down, c.route_weights)
            self.last_backend = "masked"
            return c.shared_scale * shared + c.routed_scale * routed

    return MaskedExperts


def build_anchor(ctx: Ctx, holder: dict):
    """Case compile_masked: our model at the preset, experts masked, PyTorch norm/RoPE, the plain
    (full-logits) loss, fp32 weights under bf16 autocast, torch.compile, fused AdamW."""
    from ds_trhash.training.engine import param_groups

    model = ctx.new_model()
    masked = _masked_engine_class()
    for engine in model.engines():
        engine.__class__ = masked  # same parameters and buffers, another forward
    model.set_backends(loss="plain")
    model = model.to(ctx.device)  # fp32 weights
    holder["model"] = model
    opt_cfg = ctx.train_cfg.optimizer
    opt = _adamw(param_groups(model, opt_cfg.weight_decay), opt_cfg, ctx.device)
    holder["opt"] = opt
    fwd = torch.compile(model)
    holder["fwd"] = fwd
    params = [p for p in model.parameters() if p.requires_grad]
    mixed = ctx.dtype != torch.float32

    def forward(ids, labels):
        with torch.autocast(ctx.device.type, dtype=ctx.dtype, enabled=mixed):
            return fwd(ids, labels=labels)

    def step():
        loss = _accumulate(ctx, forward)
        if opt_cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, opt_cfg.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, {"kernel_choice": None, "autocast": str(ctx.dtype) if mixed else None}


def build_plain(ctx: Ctx, compiled: bool, holder: dict):
    """Cases eager / compile: the model's default backends, weights in the run dtype."""
    from ds_trhash.training.engine import param_groups

    model = ctx.new_model().to(ctx.device, ctx.dtype)
    holder["model"] = model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _adamw(param_groups(model, ctx.train_cfg.optimizer.weight_decay), ctx.train_cfg.optimizer, ctx.device)
    holder["opt"] = opt
    fwd = torch.compile(model) if compiled else model
    holder["fwd"] = fwd
    clip = ctx.train_cfg.optimizer.grad_clip

    def step():
        loss = _accumulate(ctx, lambda ids, labels: fwd(ids, labels=labels))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, {"kernel_choice": None}


# ----------------------------------------------------------------------------- the engine's kernels


def _masters(groups: list[dict]):
    """fp32 copies of the run-dtype parameters, grouped as ``groups``, each with an fp32 .grad."""
    params = [p for g in groups for p in g["params"]]
    masters = {id(p): p.detach().float().clone() for p in params}
    master_groups = [{**g, "params": [masters[id(p)] for p in g["params"]]} for g in groups]
    master_list = [masters[id(p)] for p in params]
    for m in master_list:
        m.grad = torch.zeros_like(m)
    return params, master_groups, master_list


def build_manual(ctx: Ctx, holder: dict):
    """Case manual: the engine's kernels and numerics (fp32 master weights) without DeepSpeed."""
    from ds_trhash.model import backend
    from ds_trhash.training.engine import param_groups

    model = ctx.new_model()
    choice = ctx.kernel_choice()
    backend.apply(model, choice)
    model = model.to(ctx.device, ctx.dtype)
    holder["model"] = model
    opt_cfg = ctx.train_cfg.optimizer
    groups = param_groups(model, opt_cfg.weight_decay)
    mixed = ctx.dtype != torch.float32
    if mixed:
        params, master_groups, master_list = _masters(groups)
        master_grads = [m.grad for m in master_list]
        holder["masters"] = master_list
    else:
        params = master_list = [p for g in groups for p in g["params"]]
        master_groups = groups
    opt = _adamw(master_groups, opt_cfg, ctx.device)
    holder["opt"] = opt
    clip = opt_cfg.grad_clip

    def step():
        loss = _accumulate(ctx, lambda ids, labels: model(ids, labels=labels))
        if mixed:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            torch._foreach_copy_(master_grads, grads)  # bf16 -> fp32
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(master_list, clip, foreach=True)
        opt.step()
        if mixed:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in params], master_list)  # fp32 -> bf16
        model.zero_grad(set_to_none=True)
        return loss

    return step, {"kernel_choice": choice.to_dict()}


def build_engine_case(ctx: Ctx, compile_mode: str, holder: dict):
    """Cases engine*: the trainer's build order (resolve, self-check, apply, compile_model,
    build_engine), steps via loop.train_step over grad_accum micro-batches."""
    from ds_trhash.model import backend
    from ds_trhash.model.compile import compile_model
    from ds_trhash.training import loop
    from ds_trhash.training.engine import build_engine, check_runnable

    cfg = ctx.train_cfg
    check_runnable(cfg, 1)
    model = ctx.new_model()
    choice = ctx.kernel_choice()
    backend.apply(model, choice)
    compile_model(model, compile_mode)
    model = model.to(ctx.device)
    holder["model"] = model
    total = ctx.args.warmup + ctx.args.steps
    eng = build_engine(model, cfg, ctx.ds_config, total_steps=total)
    holder["engine"] = eng
    batches = [ctx.cpu_batch] * ctx.grad_accum
    device = eng.device

    def step():
        return loop.train_step(eng.engine, batches, device, 1)["loss"]

    return step, {"kernel_choice": choice.to_dict(), "compile": compile_mode,
                  "deterministic": cfg.training.deterministic}
