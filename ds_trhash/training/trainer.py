"""One launch of one stage: config → data → stage guard → model → engine → loop.

Everything that can refuse a launch (config, data manifests, plan identity, stage transition,
resume compatibility) runs before the model is allocated, so a wrong launch costs seconds and
writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ds_trhash.data.plan import PlanError
from ds_trhash.data.sft_dataset import SFTDataError
from ds_trhash.model.backend import BackendError
from ds_trhash.model.routing import RouteTableError
from ds_trhash.training import checkpoint as ckpt
from ds_trhash.training import config as tcfg
from ds_trhash.training import loop
from ds_trhash.training.batches import PretrainBatches, SFTStepBatches
from ds_trhash.training.engine import build_engine, check_runnable
from ds_trhash.training.stages import SourceRecord, StageError, check_launch

log = logging.getLogger("ds_trhash.trainer")

def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that describe a wrong launch (bad data, config, checkpoint): the launcher prints
    them as one line and exits 2 instead of a traceback."""
    from ds_trhash.data.budget import BudgetError
    from ds_trhash.data.cache import CacheError
    from ds_trhash.data.embedded import EmbeddedError
    from ds_trhash.data.reader import ReaderError
    from ds_trhash.data.shards import ShardError
    from ds_trhash.data.sft_build import SFTBuildError
    from ds_trhash.data.tokenizer import TokenizerError
    from ds_trhash.eval.piqa import PiqaDataError
    from ds_trhash.model.lora import LoRAError
    from ds_trhash.training.metrics import MetricsError
    from ds_trhash.training.rng import RNGStateError

    return (PlanError, SFTDataError, BackendError, RouteTableError, FileNotFoundError, loop.LabelError,
            BudgetError, CacheError, EmbeddedError, ReaderError, ShardError, SFTBuildError, TokenizerError,
            LoRAError, MetricsError, RNGStateError, PiqaDataError)


USER_ERRORS = _user_errors()


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank0_first(rank: int, fn):
    """Run ``fn`` on rank 0 first, then on the others: shared on-disk builds (demo corpus) are
    made once and only read by the other ranks."""
    result = fn() if rank == 0 else None
    _barrier()
    if rank != 0:
        result = fn()
    return result


# ----------------------------------------------------------------------------- data


@dataclass
class StageData:
    batches: object  # loop.StepBatches
    total_steps: int
    plan: object | None = None  # ReplayPlan (pretraining, refinement)
    eval_batches: object | None = None  # SFTBatches over the eval partition
    tokenizer_dir: str | None = None
    tokenizer_sha256: str | None = None  # identity of the tokenizer the data was made with
    sft_dir: str | None = None  # the resolved SFT set (the embedded one when the config says null)
    describe: str = ""


def _embedded_root(cfg: tcfg.TrainConfig) -> Path:
    return Path(cfg.output_dir).resolve().parent / "embedded"


def _embedded(cfg: tcfg.TrainConfig, rank: int):
    if cfg.model.preset != "tiny":
        raise tcfg.ConfigError(cfg.origin, "data.plan" if cfg.data.kind == "pretrain" else "data.sft_dir",
                               "required for the 200m preset (the embedded demo corpus is for the tiny preset only)")
    from ds_trhash.data.embedded import build_embedded

    return _rank0_first(rank, lambda: build_embedded(_embedded_root(cfg), seq_len=cfg.data.seq_len))


def _max_steps(cfg: tcfg.TrainConfig, steps: int) -> int:
    return min(steps, cfg.training.max_steps) if cfg.training.max_steps else steps


def prepare_pretrain_data(cfg: tcfg.TrainConfig, rank: int, world: int) -> StageData:
    from ds_trhash.data.budget import check_target_tokens, plan_steps
    from ds_trhash.data.cache import ShardCache, cache_bytes_from
    from ds_trhash.data.plan import load_plan
    from ds_trhash.data.reader import ReplayReader

    if cfg.data.plan is None:
        paths = _embedded(cfg, rank)
        plan_path = paths.refine_plan if cfg.stage == "refinement" else paths.pretrain_plan
        shards_dir, tokenizer_dir = paths.shards_dir, paths.tokenizer_dir
    else:
        plan_path, shards_dir, tokenizer_dir = cfg.data.plan, cfg.data.shards_dir, cfg.data.tokenizer
        if shards_dir is None:
            raise tcfg.ConfigError(cfg.origin, "data.shards_dir", "required when data.plan is set")
    plan = load_plan(plan_path)
    if plan.seq_len != cfg.data.seq_len:
        raise tcfg.ConfigError(cfg.origin, "data.seq_len",
                               f"{cfg.data.seq_len} differs from the plan's seq_len {plan.seq_len} ({plan_path})")
    env_target = os.environ.get("TARGET_TOKENS")
    check_target_tokens(plan.doc, env_target if env_target not in (None, "") else cfg.data.target_tokens)
    steps = plan_steps(plan, tcfg.tokens_per_step(cfg, world), requested_steps=cfg.training.max_steps)
    from ds_trhash.data.reader import source_manifests

    # Every shard is read through the bounded cache, which verifies its SHA-256 against the
    # manifest before a single row is trained on (one cache folder per rank).
    cache_dir = Path(cfg.data.cache_dir or Path(cfg.output_dir) / "shard_cache") / f"rank_{rank}"
    cache = ShardCache(shards_dir, cache_dir, cache_bytes_from(cfg.data.cache_gb, os.environ),
                       source_manifests(shards_dir, plan))
    reader = ReplayReader(plan, shards_dir, cfg.seed, cache=cache)
    batches = PretrainBatches(reader, cfg.batch.micro_batch, cfg.batch.grad_accum, rank, world)
    return StageData(batches=batches, total_steps=_max_steps(cfg, steps), plan=plan,
                     tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None,
                     tokenizer_sha256=plan.doc.get("tokenizer_sha256"),
                     describe=f"plan {plan_path} fingerprint {plan.fingerprint[:12]}")


def prepare_sft_data(cfg: tcfg.TrainConfig, model_cfg, rank: int, world: int) -> StageData:
    from ds_trhash.data.sft_dataset import SFTBatches, open_sft, pack

    sft_dir = cfg.data.sft_dir
    if sft_dir is None:
        paths = _embedded(cfg, rank)

        def build():
            from ds_trhash.data.sft_build import build_sft_dataset

            out = Path(paths.root) / "sft"
            if not (out / "manifest.json").exists():
                build_sft_dataset(paths.chat_train_jsonl, paths.chat_eval_jsonl, paths.tokenizer_dir,
                                  cfg.data.seq_len, out, source_name="pydoc_data.topics", revision="python-stdlib")
            return out

        sft_dir = _rank0_first(rank, build)
    tokenizer_hash = None
    if cfg.data.tokenizer:
        from ds_trhash.data.tokenizer import tokenizer_sha256

        tokenizer_hash = tokenizer_sha256(cfg.data.tokenizer)
    data = open_sft(sft_dir, expect_vocab=model_cfg.vocab_size, seq_len=cfg.data.seq_len, tokenizer_hash=tokenizer_hash)
    policy = cfg.data.packing.policy
    train_packs = pack(data.partition("train"), cfg.data.seq_len, policy)
    train = SFTBatches(train_packs, cfg.batch.micro_batch, world, rank, cfg.seed, drop_last=True)
    batches = SFTStepBatches(train, cfg.batch.grad_accum, policy)
    if batches.steps_per_epoch < 1:
        raise SFTDataError(
            f"{train.batches_per_epoch} micro-batches per epoch make no optimizer step with grad_accum "
            f"{cfg.batch.grad_accum}; lower batch.grad_accum or batch.micro_batch")
    eval_batches = None
    if cfg.eval.heldout:
        eval_packs = pack(data.partition("eval"), cfg.data.seq_len, policy)
        eval_batches = SFTBatches(eval_packs, cfg.batch.micro_batch, world, rank, cfg.seed, drop_last=False)
    total = _max_steps(cfg, batches.steps_per_epoch * cfg.training.epochs)
    return StageData(batches=batches, total_steps=total, eval_batches=eval_batches,
                     tokenizer_dir=str(data.tokenizer_path), tokenizer_sha256=data.tokenizer_hash,
                     sft_dir=str(Path(sft_dir).resolve()),
                     describe=f"SFT set {sft_dir}")


# ----------------------------------------------------------------------------- launch checks


def _source_record(init_dir: str | None) -> tuple[SourceRecord | None, dict]:
    if init_dir is None:
        return None, {}
    meta = ckpt.read_source_metadata(init_dir)
    return SourceRecord.from_mapping(meta, path=str(init_dir)), meta


def check_tokenizer_identity(source_meta: dict, data: StageData, init_dir: str) -> None:
    """The data of the next stage must be tokenized exactly like the source model's: token ids
    (and with them the persisted routes) mean nothing under another tokenizer."""
    theirs, ours = source_meta.get("tokenizer_sha256"), data.tokenizer_sha256
    if theirs and ours and theirs != ours:
        raise StageError(
            f"the data of this launch was tokenized with tokenizer {ours[:12]}…, but {init_dir} was trained with "
            f"tokenizer {theirs[:12]}…; rebuild the data with the checkpoint's tokenizer")


def check_fresh_output_dir(output_dir: Path) -> None:
    """A fresh start never writes over a run: its checkpoints and metrics would be mixed with
    the new ones. Continuing that run is an explicit --resume."""
    done = [c.name for c in ckpt.list_checkpoints(output_dir) if c.has_manifest]
    if done or (output_dir / "metrics.csv").exists():
        what = f"checkpoints {', '.join(done[-3:])}" if done else "a metrics.csv"
        raise ckpt.CheckpointError(
            f"{output_dir} already holds a run ({what}); continue it with --resume auto, or start this "
            "launch in a new --output-dir")


def guard_stage(cfg: tcfg.TrainConfig, init_dir: str | None, data: StageData, resuming: bool) -> SourceRecord | None:
    """SPEC §3, before the model exists. A resume re-checks the record of the first launch."""
    from ds_trhash.data.plan import unique_core_fingerprint, validate_refinement

    record, source_meta = _source_record(init_dir)
    if record is None and resuming:
        return None
    if record is not None:
        check_tokenizer_identity(source_meta, data, init_dir)
    check_launch(
        cfg.stage, record,
        source_stage_flag=cfg.source_stage,
        target_plan_doc=data.plan.doc if data.plan is not None else None,
        source_plan_doc=source_meta.get("plan_doc"),
        fresh_optimizer=True,
        family=cfg.model.family,
        validate_refinement=validate_refinement,
        plan_fingerprint=unique_core_fingerprint,
    )
    return record


# ----------------------------------------------------------------------------- model


def build_model(cfg: tcfg.TrainConfig, model_cfg, init_dir: str | None, device: torch.device, rank: int):
    from ds_trhash.model import TRHashForCausalLM
    from ds_trhash.model import backend

    torch.manual_seed(cfg.seed)
    model = TRHashForCausalLM(model_cfg)
    if init_dir is not None:
        state_dict, _ = ckpt.load_merged_weights(init_dir)  # an SFT→SFT LoRA source arrives merged
        differences = model.load_checkpoint_state(state_dict)
        for line in differences:
            log.warning("routes kept from the checkpoint: %s", line)
    if cfg.lora.enabled:
        from ds_trhash.model.lora import apply_lora

        apply_lora(model, cfg.lora)
    model.set_activation_checkpointing(cfg.model.activation_checkpointing, cfg.model.activation_checkpointing_every)
    if cfg.parallel.ep_size > 1:
        # Full model first (same init / init-checkpoint as ep_size 1), then keep this rank's experts.
        from ds_trhash.model.expert_parallel import enable_expert_parallel
        from ds_trhash.training.engine import expert_parallel_group

        enable_expert_parallel(model, cfg.parallel.ep_size, group=expert_parallel_group(cfg.parallel.ep_size))
    choice = backend.resolve(cfg.kernels.policy, device, model_cfg, require_liger=cfg.kernels.require_liger)
    backend.apply(model, choice)
    model.kernels_requested = choice.to_dict()  # for the startup summary
    if rank == 0:
        log.info("kernels requested: %s (%s)", choice.to_dict(), choice.reason)
    return model.to(device)


# ----------------------------------------------------------------------------- callbacks


class FaultInjection:
    """Crash on purpose, for the crash-safety tests: ``DS_TRHASH_FAULT=kill_after_step:N``
    SIGKILLs every rank right after optimizer step N (before its checkpoint), and
    ``kill_during_save:N`` SIGKILLs them inside the save of step N, after DeepSpeed wrote its
    files and before the checkpoint is complete. Unset in normal runs."""

    def __init__(self, spec: str | None):
        self.kind, self.step = None, -1
        if spec:
            kind, _, step = spec.partition(":")
            if kind not in ("kill_after_step", "kill_during_save") or not step.isdigit():
                raise ValueError(f"DS_TRHASH_FAULT={spec!r}: expected kill_after_step:N or kill_during_save:N")
            self.kind, self.step = kind, int(step)

    def maybe_kill(self, kind: str, step: int) -> None:
        if self.kind == kind and self.step == step:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


class FaultCallback(loop.Callback):
    def __init__(self, faults: FaultInjection):
        self.faults = faults

    def on_step_end(self, state, metrics):
        self.faults.maybe_kill("kill_after_step", state.step)


class ProgressCallback(loop.Callback):
    def __init__(self, progress, model, every: int, batches=None):
        self.progress, self.model, self.every, self.batches = progress, model, every, batches

    def on_step_end(self, state, metrics):
        self.progress.update(state.step, metrics["loss"], metrics["lr"], metrics["tok_s"],
                             backends=self.model.backends_used(), extra=self.extra())

    def extra(self) -> dict | None:
        """The shard cache's state, when the stage streams shards through one."""
        cache = getattr(getattr(self.batches, "reader", None), "cache", None)
        if cache is None:
            return None
        st = cache.stats()
        return {"cache": f"{st['bytes'] / 2**20:.1f}/{st['max_bytes'] / 2**20:.0f} MiB {st['files']} shards "
                         f"hit {st.get('hits', 0)} miss {st.get('misses', 0)} evict {st.get('evictions', 0)}"}

    def on_end(self, state):
        self.progress.close()


class MetricsCallback(loop.Callback):
    """A metrics.csv row every ``every`` steps (and the first, the last, a stop), with the train
    loss averaged over the steps since the previous row; the row also reaches the DeepSpeed
    monitors through the writer, and the monitors get peak memory, MFU and expert load."""

    def __init__(self, writer, model, every: int, sink=None, device=None, mfu=None):
        from ds_trhash.training.monitor import IntervalMean

        self.writer, self.model, self.every = writer, model, every
        self.sink, self.device, self.mfu = sink, device, mfu  # mfu: tokens/s -> fraction or None
        self.interval = IntervalMean()

    def on_step_end(self, state, metrics):
        self.interval.add(loss=metrics["loss"])
        regular = state.step % self.every == 0 or state.step in (1, state.total_steps)
        if regular or state.stop_requested:
            b = self.model.backends_used()
            self.writer.write(
                step=state.step, epoch=metrics["epoch"], train_loss=metrics["loss"], lr=metrics["lr"],
                tok_s=metrics["tok_s"], tokens_seen=metrics["tokens_seen"],
                supervised_tokens=metrics["supervised_tokens"], label_valid=metrics["label_valid"],
                label_ignored=metrics["label_ignored"], label_out_of_range=metrics["label_out_of_range"],
                experts_backend=b.get("experts"),
                loss_backend=b.get("loss"), norm_backend=b.get("norm"),
                train_loss_avg=self.interval.take()["loss"], grad_norm=metrics.get("grad_norm"),
                step_time=metrics.get("step_time"),
            )
        if regular and self.sink is not None and self.sink.enabled:
            from ds_trhash.training.monitor import expert_load, peak_memory_mib

            events = {"Train/peak_memory_mib": peak_memory_mib(self.device),
                      **expert_load(self.model, self.device)}  # every rank: the counts are all-reduced
            if self.mfu is not None:
                events["Train/mfu"] = self.mfu(metrics["tok_s"])
            self.sink.write(state.step, events)


class EvalCallback(loop.Callback):
    """Held-out loss at the start (the source checkpoint) and at every epoch boundary."""

    def __init__(self, model, eval_batches, device, writer, progress):
        self.model, self.eval_batches, self.device = model, eval_batches, device
        self.writer, self.progress = writer, progress
        self.results: dict[int, dict] = {}

    def evaluate(self, state) -> dict:
        from ds_trhash.eval.heldout import heldout_loss

        result = heldout_loss(self.model, self.eval_batches.epoch(0), self.device)
        result.update(step=state.step, epoch=state.epoch)
        self.results[state.step] = result
        self.writer.write(step=state.step, epoch=state.epoch, eval_loss=result["eval_loss"],
                          eval_tokens=result["eval_tokens"])
        self.progress.message(
            f"held-out at step {state.step}: loss {result['eval_loss']:.4f} ppl {result['eval_ppl']:.2f} "
            f"over {result['eval_tokens']:,} supervised tokens")
        return result

    def on_start(self, state):
        if state.step == 0:
            self.evaluate(state)

    def on_epoch_end(self, state):
        self.evaluate(state)


class PiqaCallback(loop.Callback):
    """Zero-shot PIQA (SPEC §8) on rank 0: the SFT source at step 0 and every epoch end, or the
    end of a pretraining/refinement stage. Results go to ``piqa.jsonl`` beside metrics.csv."""

    def __init__(self, model, examples, tokenizer, max_len: int, output_dir: Path, rank: int, progress,
                 sft: bool):
        self.model, self.examples, self.tokenizer, self.max_len = model, examples, tokenizer, max_len
        self.output_dir, self.rank, self.progress, self.sft = output_dir, rank, progress, sft
        self.results: dict[int, dict] = {}

    def evaluate(self, state) -> None:
        import warnings

        from ds_trhash.eval.piqa import PiqaCountWarning, evaluate_piqa

        if self.rank == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PiqaCountWarning)  # reported in the result's "warning"
                result = evaluate_piqa(self.model, self.tokenizer, self.examples, max_len=self.max_len)
            row = {"step": state.step, "epoch": state.epoch, **{k: result[k] for k in ("acc", "acc_norm", "n")},
                   "warning": result.get("warning")}
            self.results[state.step] = row
            with open(self.output_dir / "piqa.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            self.progress.message(f"PIQA at step {state.step}: acc {result['acc']:.4f} "
                                  f"acc_norm {result['acc_norm']:.4f} over {result['n']} examples")
        _barrier()

    def on_start(self, state):
        if self.sft and state.step == 0:
            self.evaluate(state)

    def on_epoch_end(self, state):
        if self.sft:
            self.evaluate(state)

    def on_end(self, state):
        if not self.sft and state.step == state.total_steps:
            self.evaluate(state)


class CheckpointCallback(loop.Callback):
    """Writes crash-safe checkpoints at the configured cadence, token-pack boundaries, epoch
    ends, on a stop signal and at the end; rotates old ones."""

    def __init__(self, engine, cfg, output_dir: Path, trainer_state_fn, rank: int, world: int,
                 protect_steps: set[int], progress, faults: FaultInjection, eval_results: dict | None = None,
                 is_epoch_end=lambda step: False, piqa_results: dict | None = None):
        self.engine, self.cfg, self.output_dir, self.faults = engine, cfg, output_dir, faults
        self.eval_results = eval_results if eval_results is not None else {}
        self.last_path: Path | None = None
        self.is_epoch_end = is_epoch_end  # those steps are saved by on_epoch_end, with their eval
        self.piqa_results = piqa_results if piqa_results is not None else {}
        self.trainer_state_fn, self.rank, self.world = trainer_state_fn, rank, world
        self.protect = set(protect_steps)
        self.progress = progress
        self.last_saved = -1

    def save(self, state, reason: str, extra: dict | None = None):
        if state.step == self.last_saved:
            return
        t0 = time.perf_counter()

        def write_engine_state(tmp):
            self.engine.save_checkpoint(str(tmp), tag="state")
            self.faults.maybe_kill("kill_during_save", state.step)

        path = ckpt.save_checkpoint(
            self.output_dir, state.step,
            write_engine_state=write_engine_state,
            trainer_state=self.trainer_state_fn(state, reason, extra or {}),
            rank=self.rank, world_size=self.world, barrier=_barrier,
        )
        self.last_saved, self.last_path = state.step, path
        if self.rank == 0 and self.cfg.checkpoint.keep_last:
            ckpt.rotate(self.output_dir, self.cfg.checkpoint.keep_last, protect=self.protect)
        self.progress.message(f"checkpoint {path.name if path else state.step} ({reason}, {time.perf_counter() - t0:.1f}s)")

    def on_step_end(self, state, metrics):
        every = self.cfg.checkpoint.every_steps
        if self.is_epoch_end(state.step):
            return
        if state.stop_requested:
            self.save(state, "stop signal")
        elif state.step in self.protect:
            self.save(state, "token pack boundary")
        elif every and state.step % every == 0:
            self.save(state, "every_steps")

    def on_epoch_end(self, state):
        self.protect.add(state.step)
        self.save(state, f"end of epoch {state.epoch}",
                  {"eval": self.eval_results.get(state.step), "piqa": self.piqa_results.get(state.step)})

    def on_end(self, state):
        if state.step == state.total_steps:
            self.save(state, "final")


class SelectionCallback(loop.Callback):
    """After each epoch checkpoint: ``best/`` and ``selection.json`` under the configured rule."""

    def __init__(self, output_dir: Path, rule: str, ckpt_cb: CheckpointCallback, eval_results: dict,
                 rank: int, progress, piqa_results: dict | None = None):
        self.output_dir, self.rule, self.ckpt_cb = output_dir, rule, ckpt_cb
        self.eval_results, self.rank, self.progress = eval_results, rank, progress
        self.piqa_results = piqa_results if piqa_results is not None else {}
        self.candidates: list = []

    def on_start(self, state):
        """A resumed run keeps the candidates of the epochs it already finished."""
        from ds_trhash.training.selection import Candidate

        path = self.output_dir / "selection.json"
        if state.step > 0 and path.is_file():
            done = json.loads(path.read_text())["candidates"]
            self.candidates = [Candidate(**c) for c in done if c["step"] <= state.step]

    def on_epoch_end(self, state):
        from ds_trhash.training.selection import Candidate, publish

        if self.rank != 0 or self.ckpt_cb.last_path is None:
            return
        ev = self.eval_results.get(state.step) or {}
        piqa = self.piqa_results.get(state.step) or {}
        self.candidates.append(Candidate(
            epoch=state.epoch + 1, step=state.step, checkpoint=str(self.ckpt_cb.last_path),
            eval_loss=ev.get("eval_loss"), eval_ppl=ev.get("eval_ppl"), eval_tokens=ev.get("eval_tokens"),
            train_loss=state.last.get("loss"), piqa_acc=piqa.get("acc"), piqa_acc_norm=piqa.get("acc_norm")))
        winner = publish(self.output_dir, self.candidates, self.rule)
        self.progress.message(f"best/ = epoch {winner.epoch} (step {winner.step}) under rule {self.rule}")


# ----------------------------------------------------------------------------- the stage


def run_stage(cfg: tcfg.TrainConfig, args, rank: int, world: int) -> loop.TrainState:
    from ds_trhash.model import TRHashConfig
    from ds_trhash.training.metrics import MetricsWriter
    from ds_trhash.training.progress import Progress
    from ds_trhash.training.rng import load_rng_state, restore_rng_state

    tcfg.require_source_stage(cfg)
    check_runnable(cfg, world)
    loaded, cfg = cfg, tcfg.for_world(cfg, world)  # batch.grad_accum derived for this world size
    output_dir = Path(cfg.output_dir)
    model_cfg = dataclasses.replace(TRHashConfig.from_preset(cfg.model.preset),
                                    loss_chunk_tokens=cfg.kernels.loss_chunk_tokens)

    # --- everything that can refuse the launch, before the model exists
    data = (prepare_sft_data(cfg, model_cfg, rank, world) if cfg.data.kind == "sft"
            else prepare_pretrain_data(cfg, rank, world))
    resume_dir = ckpt.resolve_resume(args.resume, os.environ.get("RESUME"), output_dir)
    saved = ckpt.read_trainer_state(resume_dir) if resume_dir else None
    init_dir = args.init_checkpoint
    if saved is not None and init_dir is None:
        init_dir = saved.get("init_checkpoint")
    ckpt.check_output_dir_stage(output_dir, cfg.stage)
    if saved is None and not args.resume and not os.environ.get("RESUME"):
        check_fresh_output_dir(output_dir)
    guard_stage(cfg, init_dir, data, resuming=saved is not None)
    piqa_examples = None
    if cfg.eval.piqa:
        from ds_trhash.eval.piqa import read_piqa

        piqa_examples = read_piqa(cfg.eval.piqa)  # a malformed file fails here, before the model
    critical = tcfg.training_critical(cfg, world)
    resharding = False  # --reshard onto another world size: universal load, re-seeded RNG
    if saved is not None:
        ckpt.check_resume_compatible(
            saved, critical, world_size=world, lora_enabled=cfg.lora.enabled,
            total_steps=data.total_steps, stage=cfg.stage, reshard=args.reshard,
            plan_sha256=data.plan.sha256 if data.plan is not None else None,
            found=ckpt.inspect_saved_parts(resume_dir),
        )
        resharding = ckpt.is_reshard(saved, world, args.reshard)

    # --- model and engine
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = build_model(cfg, model_cfg, init_dir if saved is None else None, device, rank)
    ds_config = tcfg.to_deepspeed_dict(cfg, world)
    engine = build_engine(model, cfg, ds_config, data.total_steps,
                          load_universal=resharding and ckpt.needs_universal(resume_dir))
    state = loop.TrainState(step=0, total_steps=data.total_steps)
    if saved is not None:
        ckpt.load_engine_state(engine.engine, resume_dir, reshard=resharding, output_dir=output_dir,
                               rank=rank, barrier=_barrier, log=log.info)
        state.step = int(saved["step"])
        state.tokens_seen = int(saved.get("tokens_seen", 0))
        state.supervised_seen = int(saved.get("supervised_seen", 0))
        if resharding:
            ckpt.reseed_rng_for_reshard(cfg.seed, state.step, rank)
            if rank == 0:
                log.warning(ckpt.reshard_report(saved, critical, world))
        else:
            restore_rng_state(load_rng_state(resume_dir, rank))

    # --- pluggable parts
    progress = Progress(cfg.stage, data.total_steps, rank, every=cfg.training.log_every, start_step=state.step)
    from ds_trhash.training.engine import describe_hardware, optimizer_name
    from ds_trhash.training.summary import startup_summary

    hardware = f"{world} process(es); rank 0 on {describe_hardware()}"
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.json").write_text(json.dumps(tcfg.dump_config(loaded), indent=2))
        progress.message(
            f"{cfg.stage}: {cfg.model.preset} on {world} process(es), {data.describe}, "
            f"{data.total_steps} optimizer steps"
            + (f", resuming at step {state.step} from {resume_dir}" if saved is not None else ""))
        progress.message(startup_summary(
            cfg, tcfg.batch_layout(loaded, world), model=model, total_steps=data.total_steps, start_step=state.step,
            ds_config=ds_config, optimizer=optimizer_name(engine.optimizer, cfg.optimizer),
            kernels=getattr(model, "kernels_requested", None), hardware=describe_hardware(),
            checkpointed_layers=[i for i, layer in enumerate(model.layers) if layer.checkpointed]))
    from ds_trhash.model.flops import train_flops_per_token
    from ds_trhash.training.monitor import MonitorSink, model_flops_utilisation

    sink = MonitorSink(getattr(engine.engine, "monitor", None))
    model.track_expert_load = sink.enabled
    flops_per_token = train_flops_per_token(model_cfg, cfg.data.seq_len)
    writer = MetricsWriter(output_dir / "metrics.csv", rank, resume_step=state.step if saved is not None else None,
                           on_row=sink.row)
    from ds_trhash.data.budget import pack_boundaries

    pack_of: dict[int, int] = {}  # token-pack boundary step -> pack number (1-based)
    if cfg.data.kind == "pretrain" and cfg.checkpoint.packs:
        pack_of = {b: i + 1 for i, b in enumerate(pack_boundaries(data.total_steps, cfg.checkpoint.packs))}
    protect = set(pack_of)  # never rotated away: token-pack boundaries and epoch checkpoints
    if cfg.data.kind == "sft":
        spe = data.batches.steps_per_epoch
        protect |= {spe * e for e in range(1, cfg.training.epochs + 1) if spe * e <= data.total_steps}


    def trainer_state(st: loop.TrainState, reason: str, extra: dict) -> dict:
        return {
            "stage": cfg.stage,
            "family": cfg.model.family,
            "step": st.step,
            "epoch": data.batches.epoch_of(st.step) if st.step < st.total_steps else st.epoch,
            "total_steps": st.total_steps,
            "data_cursor": data.batches.cursor(st.step),
            "tokens_seen": st.tokens_seen,
            "supervised_seen": st.supervised_seen,
            "world_size": world,
            "training_critical": critical,
            "plan_fingerprint": data.plan.fingerprint if data.plan is not None else None,
            "plan_sha256": data.plan.sha256 if data.plan is not None else None,
            "plan_doc": data.plan.doc if data.plan is not None else None,
            "init_checkpoint": str(init_dir) if init_dir else None,
            "lora": cfg.lora.enabled,
            "backends_used": model.backends_used(),
            "model_config": model_cfg.to_dict(),
            "tokenizer_dir": data.tokenizer_dir,
            "tokenizer_sha256": data.tokenizer_sha256,
            "sft_dir": data.sft_dir,
            "hardware": hardware,
            "pack_index": pack_of.get(st.step),
            "packs": len(pack_of) or None,
            "reason": reason,
            **extra,
        }

    faults = FaultInjection(os.environ.get("DS_TRHASH_FAULT"))
    callbacks: list[loop.Callback] = [FaultCallback(faults)]
    eval_results: dict = {}
    if data.eval_batches is not None:
        eval_cb = EvalCallback(engine.engine, data.eval_batches, device, writer, progress)
        eval_results = eval_cb.results
        callbacks.append(eval_cb)
    piqa_results: dict = {}
    if piqa_examples is not None:
        from ds_trhash.data.tokenizer import load_tokenizer

        piqa_cb = PiqaCallback(model, piqa_examples, load_tokenizer(data.tokenizer_dir), model_cfg.max_seq_len,
                               output_dir, rank, progress, sft=cfg.data.kind == "sft")
        piqa_results = piqa_cb.results
        callbacks.append(piqa_cb)
    ckpt_cb = CheckpointCallback(engine.engine, cfg, output_dir, trainer_state, rank, world, protect, progress,
                                 faults, eval_results,
                                 is_epoch_end=lambda step: data.batches.epoch_of(step) != data.batches.epoch_of(step - 1),
                                 piqa_results=piqa_results)
    callbacks += [MetricsCallback(writer, model, cfg.training.log_every, sink=sink, device=device,
                                  mfu=lambda tok_s: model_flops_utilisation(tok_s, flops_per_token, world,
                                                                            cfg.precision, device)),
                  ProgressCallback(progress, model, cfg.training.log_every, data.batches), ckpt_cb]
    if cfg.data.kind == "sft":
        callbacks.append(SelectionCallback(output_dir, cfg.eval.select, ckpt_cb, eval_results, rank, progress,
                                           piqa_results))

    with ckpt.GracefulStop() as stop:
        state = loop.run(engine.engine, data.batches, state, callbacks, device, world,
                         lr_of=lambda: engine.optimizer.param_groups[0]["lr"], stop_flag=lambda: stop.should_stop,
                         vocab_size=model_cfg.vocab_size)
    cache = getattr(getattr(data.batches, "reader", None), "cache", None)
    if cache is not None:
        cache.close()
    if rank == 0:
        progress.message(f"{cfg.stage} finished at step {state.step}/{state.total_steps}")
    return state
