"""Stage data: what a launch trains on, checked before any model exists, behind one call.

``open_stage_data(request)`` takes a :class:`StageRequest` (the config's ``data:`` section and the
few figures of the launch it needs) and returns a :class:`StageData`. For pretraining and
refinement it loads the replay plan, checks the token budget, asks the stream its one question
(``data.stream.corpus.shared_corpus``: the store's commit, every planned shard listed with its
size, the plan against the manifests), checks the tokenizer identity and the cache bound; for SFT
it opens the tokenized set and packs it. With no plan (no SFT set) it builds the embedded demo
corpus first, once, beside the output directory. The ``StageData`` is complete at construction;
its ``loader`` is the stage's ``DataLoader``: the pretraining stream (its reader, background
assembly and shard cache) is created only by ``loader.open``, once every launch check has passed,
and closed by ``loader.close``, which the trainer calls in a ``finally``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from pathlib import Path

import torch

from ds_trhash.data.plans.budget import check_target_tokens, plan_steps
from ds_trhash.data.stream.cache import CACHE_DIR_ENV, CACHE_ENV, cache_bytes_from, cache_dir_of, check_cache_place
from ds_trhash.data.stream.corpus import Corpus, check_same_bytes, moved_note, resume_commit, shared_corpus
from ds_trhash.data.stream.delivery import agreed_node_count
from ds_trhash.data.stream.store import LOCAL_COMMIT
from ds_trhash.data.embedded import EmbeddedPaths, build_embedded
from ds_trhash.data.plans.plan import ReplayPlan, load_plan
from ds_trhash.data.sft.build import build_sft_dataset
from ds_trhash.data.sft.dataset import SFTBatches, SFTDataError, open_sft, pack
from ds_trhash.data.formats.tokenizer import tokenizer_sha256
from ds_trhash.data.formats.tokenizer_check import check_tokenizer_matches, data_tokenizer_identity
from ds_trhash.batch_layout import BatchLayout, step_tokens
from ds_trhash.config_fields import ConfigError
from ds_trhash.data.config import DataSection
from ds_trhash.data.stage.loader import DataLoader, PretrainLoader, SFTLoader, StreamRecipe
from ds_trhash.ranks import barrier, ranks_on_node
from ds_trhash.io import sha256_file

T = TypeVar("T")


def _rank0_first(rank: int, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 first, then on the others: shared on-disk builds (demo corpus) are
    made once and only read by the other ranks."""
    if rank == 0:
        result = fn()
        barrier()
        return result
    barrier()
    return fn()


@dataclass(frozen=True)
class StageRequest:
    """What opening a stage's data needs of the launch: the config's ``data:`` section and where
    it came from (``origin``, for the errors), the stage, the output directory (the embedded demo
    corpus is built beside it), the seed, this rank's cut of the batch (``layout``, grad_accum
    derived for this world), the step cap and epochs, whether the SFT held-out partition is
    evaluated, and the model's vocabulary, preset and description (the data must fit it)."""

    data: DataSection
    stage: str  # pretraining | refinement | supervised-finetuning
    origin: str
    output_dir: str
    seed: int
    layout: BatchLayout
    vocab_size: int
    model: str  # the model, described for messages
    preset: str | None = None  # the embedded demo corpus is for the tiny preset only
    max_steps: int | None = None
    epochs: int = 1
    heldout: bool = False

    @property
    def tokens_per_step(self) -> int:
        """Token positions per optimizer step over every rank."""
        lay = self.layout
        return step_tokens(lay.micro_batch, lay.grad_accum, lay.world_size, self.data.seq_len)


@dataclass(frozen=True)
class StageData:
    """What a launch trains on, decided and checked before the model exists: the stage's loader
    (not yet reading) and what the records, the stage guard and the resume checks need of its data."""

    loader: DataLoader  # what the loop reads; opened by the trainer once every check passed
    total_steps: int
    planned_steps: int | None = None  # what the data holds; more than total_steps when --max-steps capped it
    plan: ReplayPlan | None = None  # pretraining, refinement
    eval_batches: SFTBatches | None = None  # over the SFT set's eval partition
    tokenizer_dir: str | None = None
    tokenizer_sha256: str | None = None  # identity of the tokenizer the data was made with
    sft_dir: str | None = None  # the resolved SFT set (the embedded one when the config says null)
    sft_manifest_sha256: str | None = None  # identity of that set, compared on --resume
    shards_dir: str | None = None  # where the plan's shards are (pretraining, refinement)
    data_source: dict | None = None  # {store, commit} read: recorded in every checkpoint
    tokenizer_assumed: bool = False  # the data records no tokenizer: the configured one is taken as its
    notes: tuple[str, ...] = ()  # said once by rank 0 (e.g. that the corpus records no tokenizer)
    describe: str = ""


def embedded_root(output_dir: str | Path) -> Path:
    """Where a launch builds the embedded demo corpus: beside its output directory, shared by runs."""
    return Path(output_dir).resolve().parent / "embedded"


def _embedded(req: StageRequest) -> EmbeddedPaths:
    if req.preset != "tiny":
        raise ConfigError(req.origin, "data.plan" if req.data.kind == "pretrain" else "data.sft_dir",
                          f"required for {req.model} (the embedded demo corpus is for the tiny preset only)")

    return _rank0_first(req.layout.rank, lambda: build_embedded(embedded_root(req.output_dir), seq_len=req.data.seq_len))


def _max_steps(req: StageRequest, steps: int) -> int:
    return min(steps, req.max_steps) if req.max_steps else steps


def exchanging_nodes(corpus: Corpus, world: int, per_node: int) -> int:
    """The nodes that exchange rows (``data.stream.delivery.exchange``): on several nodes reading a Hub
    store, each node fills only the shards it owns and the rows travel between nodes, one Hub
    download per shard per job; 1 from a local store (each node reads its own copy). Checked
    with the launch's other checks, by every rank together: unequal nodes are refused on every
    node (``NodeLayoutError``, naming each node's rank count) before any exchange group exists."""
    return 1 if corpus.commit == LOCAL_COMMIT else agreed_node_count(world, per_node)


def _cap_note(req: StageRequest, planned: int) -> tuple[str, ...]:
    """Said at start when ``training.max_steps`` cuts the stage short (what --max-steps means)."""
    total = _max_steps(req, planned)
    if total >= planned:
        return ()
    return (f"training.max_steps {total} caps this stage at {total} of the {planned} optimizer steps its data holds: "
            "the whole schedule runs over those steps, the stage completes, and its checkpoints, "
            "stage_complete.json and run record say it was capped",)


def _held_to(saved: dict | None, corpus: Corpus, read_by: str, rank: int) -> tuple[str, ...]:
    """The corpus of this launch is the one ``saved`` records (``data.stream.corpus.pinning``): the same
    bytes under every planned name, else a refusal naming a file; a note when the branch moved."""
    fix = ("point data.shards_dir (or the plan's dataset) at the corpus it read, or start a new run"
           if read_by == "this run" else "refine on the corpus pretraining read (same store, or a copy of the "
           "same bytes), or pretrain again on this one")
    check_same_bytes(saved, corpus.record, read_by, fix)
    moved = moved_note(saved, corpus.store, corpus.commit, read_by) if rank == 0 and saved else None
    return (moved,) if moved else ()


def _checked_plan(req: StageRequest, plan_path: str | os.PathLike, target_tokens: str | None) -> ReplayPlan:
    """The replay plan, checked against the config: its seq_len, its vocabulary, the token target
    (the launch's ``TARGET_TOKENS`` when set, else ``data.target_tokens``)."""
    plan = load_plan(plan_path)
    if plan.seq_len != req.data.seq_len:
        raise ConfigError(req.origin, "data.seq_len",
                          f"{req.data.seq_len} differs from the plan's seq_len {plan.seq_len} ({plan_path})")
    plan_vocab = plan.doc.get("vocab_size")
    if isinstance(plan_vocab, int) and plan_vocab > req.vocab_size:
        raise ConfigError(req.origin, "data.plan",
                          f"the plan {plan_path} records vocab_size {plan_vocab}, more than the model's "
                          f"{req.vocab_size} ({req.model}): token ids beyond it have no "
                          "embedding; use data tokenized for this model's vocabulary")
    if target_tokens not in (None, ""):
        check_target_tokens(plan.doc, target_tokens, name="TARGET_TOKENS")
    else:
        check_target_tokens(plan.doc, req.data.target_tokens, name="data.target_tokens")
    return plan


def open_stage_data(req: StageRequest, *, saved_source: dict | None = None, read_by: str = "this run",
                    target_tokens: str | None = None, shard_hashes: str = "none",
                    hub_wait_s: float | None = None) -> StageData:
    """The stage's data, checked, its loader not yet reading: the replay plan's stream
    (pretraining, refinement) or the packed SFT set; the embedded demo corpus when the config names
    neither. ``saved_source``: the ``data_source`` a resumed checkpoint recorded (its commit is
    read again); ``read_by``: whose record that is ("this run" on a resume, "pretraining" for
    refinement); ``target_tokens``: the launch's ``TARGET_TOKENS``; ``shard_hashes``: "none"
    (sizes from one listing; bytes are verified as they enter the cache) or "all" (``preflight
    --deep``: hash every planned shard now); ``hub_wait_s``: how long a Hub store waits out an
    outage (default: ``data.hub_wait_minutes``)."""
    if req.data.kind == "sft":
        return _sft_data(req)
    return _pretrain_data(req, shard_hashes, saved_source, hub_wait_s, read_by, target_tokens)


def _pretrain_data(req: StageRequest, shard_hashes: str, saved_source: dict | None, hub_wait_s: float | None,
                   read_by: str, target_tokens: str | None) -> StageData:
    data, rank, world = req.data, req.layout.rank, req.layout.world_size
    if data.plan is None:
        paths = _embedded(req)
        plan_path: str | os.PathLike = paths.refine_plan if req.stage == "refinement" else paths.pretrain_plan
        shards_dir: str | None = str(paths.shards_dir)
        tokenizer_dir: str | os.PathLike | None = paths.tokenizer_dir
    else:
        plan_path, shards_dir, tokenizer_dir = data.plan, data.shards_dir, data.tokenizer
    plan = _checked_plan(req, plan_path, target_tokens)
    planned = plan_steps(plan, req.tokens_per_step)
    total = _max_steps(req, plan_steps(plan, req.tokens_per_step, requested_steps=req.max_steps))

    # Before the model and engine: the revision pinned, every planned shard listed with its size.
    resume_commit(shards_dir, plan.doc, saved_source)  # asking for another commit explicitly is refused
    wait_s = data.hub_wait_minutes * 60 if hub_wait_s is None else hub_wait_s
    corpus = shared_corpus(plan, shards_dir, str(req.origin), saved_source, rank, deep=shard_hashes == "all",
                           hub_wait_s=wait_s)
    node_ranks = ranks_on_node(world)
    nodes = exchanging_nodes(corpus, world, node_ranks)  # a collective: before any check that depends on the node
    notes = _held_to(saved_source, corpus, read_by, rank)
    recorded = {f"the plan {plan_path}": plan.doc.get("tokenizer_sha256"),
                **{f"the {source} shard manifest": m.tokenizer_sha256 for source, m in corpus.manifests.items()}}
    check_tokenizer_matches(tokenizer_dir, recorded)
    identity, assumed, tokenizer_notes = data_tokenizer_identity(recorded, tokenizer_dir, corpus.store.description)
    max_bytes = cache_bytes_from(data.cache_gb, os.environ)
    corpus.check_cache_bound(max_bytes, node_ranks, f"data.cache_gb / {CACHE_ENV}")
    cache_dir = cache_dir_of(data.cache_dir)
    check_cache_place(cache_dir, "data.cache_dir" if data.cache_dir else f"the default shard cache ({CACHE_DIR_ENV})",
                      data.cache_on_network_fs)
    recipe = StreamRecipe(
        corpus=corpus, plan=plan, seed=req.seed, layout=req.layout, cache_dir=cache_dir, max_bytes=max_bytes,
        ranks_on_node=node_ranks, end=total, prefetch_s=data.prefetch_minutes * 60, budget_s=wait_s, nodes=nodes,
        chunk_rows=data.exchange_rows, pin_memory=torch.cuda.is_available())
    return StageData(loader=PretrainLoader(recipe), total_steps=total, planned_steps=planned, plan=plan,
                     tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None,
                     tokenizer_sha256=identity, tokenizer_assumed=assumed,
                     notes=notes + tokenizer_notes + _cap_note(req, planned),
                     shards_dir=corpus.store.description, data_source=corpus.record,
                     describe=f"plan {plan_path} fingerprint {plan.fingerprint[:12]}, shards {corpus.store.description} "
                              f"({corpus.layout} layout)")


def _sft_dir(req: StageRequest) -> Path:
    """The SFT set the config names, or the embedded one (built once, by rank 0 first)."""
    if req.data.sft_dir is not None:
        return Path(req.data.sft_dir)
    paths = _embedded(req)

    def build() -> Path:
        out = Path(paths.root) / "sft"
        if not (out / "manifest.json").exists():
            build_sft_dataset(paths.chat_train_jsonl, paths.chat_eval_jsonl, paths.tokenizer_dir,
                              req.data.seq_len, out, source_name="pydoc_data.topics", revision="python-stdlib")
        return out

    return _rank0_first(req.layout.rank, build)


def _sft_data(req: StageRequest) -> StageData:
    data, lay = req.data, req.layout
    sft_dir = _sft_dir(req)
    tokenizer_hash = tokenizer_sha256(data.tokenizer) if data.tokenizer else None
    opened = open_sft(sft_dir, expect_vocab=req.vocab_size, seq_len=data.seq_len, tokenizer_hash=tokenizer_hash)
    policy = data.packing.policy
    train_packs = pack(opened.partition("train"), data.seq_len, policy)
    train = SFTBatches(train_packs, lay.micro_batch, lay.world_size, lay.rank, req.seed, drop_last=True)
    loader = SFTLoader(train, lay.grad_accum, policy)
    if loader.steps_per_epoch < 1:
        raise SFTDataError(
            f"{train.batches_per_epoch} micro-batches per epoch make no optimizer step with grad_accum "
            f"{lay.grad_accum}; lower batch.grad_accum or batch.micro_batch")
    eval_batches = None
    if req.heldout:
        eval_packs = pack(opened.partition("eval"), data.seq_len, policy)
        eval_batches = SFTBatches(eval_packs, lay.micro_batch, lay.world_size, lay.rank, req.seed, drop_last=False)
    planned = loader.steps_per_epoch * req.epochs
    return StageData(loader=loader, total_steps=_max_steps(req, planned), planned_steps=planned,
                     eval_batches=eval_batches,
                     tokenizer_dir=str(opened.tokenizer_path), tokenizer_sha256=opened.tokenizer_hash,
                     sft_dir=str(sft_dir.resolve()),
                     sft_manifest_sha256=sha256_file(sft_dir / "manifest.json"),
                     notes=_cap_note(req, planned),
                     describe=f"SFT set {data.sft_dir if data.sft_dir is not None else sft_dir}")
