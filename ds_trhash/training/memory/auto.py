"""``batch.micro_batch: auto``: the largest micro-batch that fits, chosen before the data starts.

The candidates are the sizes that keep the global batch exact: the divisors of a rank's rows per
step (``batch.global_tokens`` / seq_len / world size; grad_accum follows). The estimate
(``preparation.footprint``) proposes the start: the largest candidate whose estimated peak fits.
On CUDA a probe then measures it (``DeviceProbe``: forward, backward and allocations the size of
the optimizer state, on a throwaway copy of the model, under a forked RNG) and walks to the
largest size whose measured peak leaves ``batch.auto_headroom`` of the device free; it frees
what it allocated before training starts, and changes no weight, RNG stream or data cursor: the
run equals one launched with the chosen number in its config. On CPU, where there is no device
memory to measure, the estimate is held against ``batch.auto_budget_gb``. Every rank takes the
smallest size any rank found (a host all-reduce), so that all cut their rows alike.
``DS_TRHASH_MEMORY_CAP=G[,G1,...]`` (tests) stands in a device of G GiB (per rank when a list)
whose peaks are the estimate's.
"""
from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ds_trhash.errors import UserError
from ds_trhash.model import TRHashForCausalLM, backend
from ds_trhash.model.config import TRHashConfig
from ds_trhash.ranks import host_all_reduce
from ds_trhash.training import config as tcfg
from ds_trhash.training.memory.sizes import fitting_sizes
from ds_trhash.training.memory.step import OTHER_REMEDIES
from ds_trhash.training.preparation.footprint import GIB, estimate, gib

MEMORY_CAP_ENV = "DS_TRHASH_MEMORY_CAP"


class NothingFits(UserError, RuntimeError):
    """Not even micro-batch 1 fits: refused before anything is written."""


class MemoryProbe(Protocol):
    """What ``choose`` measures: the device's memory and the peak of one step at a size (None:
    out of memory)."""

    where: str  # for the summary: what was measured

    def capacity(self) -> int: ...

    def peak(self, micro_batch: int) -> int | None: ...


@dataclass(frozen=True)
class AutoChoice:
    micro_batch: int
    grad_accum: int
    reasons: tuple[str, ...]  # the summary's lines

    def describe(self) -> str:
        return "\n".join(self.reasons)


class CappedProbe:
    """The test double: a device of ``cap`` bytes on which a step's peak is the estimate."""

    def __init__(self, cap: int, estimated: Callable[[int], int]):
        self.cap, self.estimated = cap, estimated
        self.where = f"{MEMORY_CAP_ENV}: a device of {gib(cap)} whose peaks are the estimate's"

    def capacity(self) -> int:
        return self.cap

    def peak(self, micro_batch: int) -> int | None:
        need = self.estimated(micro_batch)
        return need if need <= self.cap else None


def capped_probe(rank: int, estimated: Callable[[int], int]) -> CappedProbe | None:
    """``DS_TRHASH_MEMORY_CAP``'s double for this rank, or None when unset."""
    spec = os.environ.get(MEMORY_CAP_ENV)
    if not spec:
        return None
    caps = [float(v) for v in spec.split(",")]
    return CappedProbe(int(caps[min(rank, len(caps) - 1)] * GIB), estimated)


def _walk(candidates: list[int], start: int, fits: Callable[[int], bool]) -> int | None:
    """From ``start``: up while the next larger candidate fits, else down to the first that fits."""
    i = candidates.index(start)
    if fits(start):
        while i > 0 and fits(candidates[i - 1]):
            i -= 1
        return candidates[i]
    return next((c for c in candidates[i + 1:] if fits(c)), None)


def choose(cfg: tcfg.TrainConfig, model_cfg: TRHashConfig, world: int, device: torch.device, rank: int,
           probe: MemoryProbe | None = None) -> AutoChoice:
    """The micro-batch of ``batch.micro_batch: auto`` for this launch, agreed by every rank."""
    rank_rows = (cfg.batch.global_tokens or 0) // cfg.data.seq_len // world  # set: the config's checks
    candidates = fitting_sizes(rank_rows)
    device_type = "cuda" if device.type == "cuda" else "cpu"

    def estimated(m: int) -> int:
        return estimate(tcfg.for_world(tcfg.with_micro_batch(cfg, m), world), model_cfg, world, device_type).per_rank

    probe = probe or capped_probe(rank, estimated)
    headroom = cfg.batch.auto_headroom
    if probe is None:  # CPU: the estimate against the budget
        budget = int(cfg.batch.auto_budget_gb * GIB)
        where = (f"estimate only (CPU: no device memory to measure) against batch.auto_budget_gb "
                 f"{cfg.batch.auto_budget_gb:g} GiB")
        found = next((c for c in candidates if estimated(c) <= budget), None)
        peaks: dict[int, int | None] = {}
    else:
        budget, where = int(probe.capacity() * (1 - headroom)), probe.where
        peaks = {}

        def fits(m: int) -> bool:
            peaks[m] = peak = probe.peak(m)
            return peak is not None and peak <= budget

        start = next((c for c in candidates if estimated(c) <= budget), candidates[-1])
        found = _walk(candidates, start, fits)
    agreed = host_all_reduce([found or 0], "min")[0]
    if not agreed:
        raise NothingFits(f"batch.micro_batch auto: not even micro-batch 1 fits ({where}; estimate "
                          f"{gib(estimated(1))}); reduce memory otherwise: {OTHER_REMEDIES}")
    measured = ", ".join(f"{m}: {'out of memory' if p is None else gib(p)}" for m, p in sorted(peaks.items()))
    reasons = (
        f"batch.micro_batch auto: {agreed} (grad_accum {rank_rows // agreed}) among {', '.join(map(str, candidates))} "
        f"(the sizes that divide the {rank_rows} rows of a rank's step)",
        f"  fits {where}, keeping {headroom:.0%} free (batch.auto_headroom)" if probe is not None else f"  {where}",
        f"  estimated peak at {agreed}: {gib(estimated(agreed))}" + (f"; measured: {measured}" if measured else ""),
    ) + ((f"  this rank found {found}; every rank takes the smallest any rank found",) if found != agreed else ())
    return AutoChoice(agreed, rank_rows // agreed, reasons)


def by_estimate(cfg: tcfg.TrainConfig, world: int) -> tuple[tcfg.TrainConfig, AutoChoice | None]:
    """``cfg`` laid out where no device is probed (preflight, smoke): auto by the estimate against
    ``batch.auto_budget_gb``, as a CPU launch chooses; a number unchanged."""
    if cfg.batch.micro_batch != "auto":
        return cfg, None
    choice = choose(cfg, tcfg.model_config(cfg), world, torch.device("cpu"), 0)
    return tcfg.with_micro_batch(cfg, choice.micro_batch), choice


def resolve(cfg: tcfg.TrainConfig, model_cfg: TRHashConfig, world: int, device: torch.device, rank: int,
            saved: dict | None) -> tuple[tcfg.TrainConfig, AutoChoice | None]:
    """``cfg`` with ``batch.micro_batch`` a number: unchanged when it is one; on a resume the size
    the run recorded; else ``choose``."""
    if cfg.batch.micro_batch != "auto":
        return cfg, None
    recorded = (saved or {}).get("training_critical", {}).get("batch.micro_batch") if saved else None
    if isinstance(recorded, int):
        return tcfg.with_micro_batch(cfg, recorded), AutoChoice(recorded, 0, (
            f"batch.micro_batch auto: {recorded}, the size the run recorded (a resume keeps it)",))
    choice = choose(cfg, model_cfg, world, device, rank, DeviceProbe(cfg, model_cfg, world, device)
                    if device.type == "cuda" and not os.environ.get(MEMORY_CAP_ENV) else None)
    return tcfg.with_micro_batch(cfg, choice.micro_batch), choice


class DeviceProbe:
    """One step's peak on this CUDA device at a micro-batch: a throwaway copy of the model in the
    training precision with the policy's kernels, forward and backward of random tokens, plus one
    allocation the size of what the engine adds (optimizer state, master weights, DeepSpeed's
    gradient bucket). Everything is freed (``empty_cache``) after each size; the RNG is forked."""

    def __init__(self, cfg: tcfg.TrainConfig, model_cfg: TRHashConfig, world: int, device: torch.device):
        self.cfg, self.model_cfg, self.world, self.device = cfg, model_cfg, world, device
        self.where = f"measured on {torch.cuda.get_device_name(device)}"

    def capacity(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def peak(self, micro_batch: int) -> int | None:
        with torch.random.fork_rng(devices=[self.device]):
            try:
                peak = self._measure(micro_batch)
            except torch.OutOfMemoryError:
                peak = None  # the error, its frames and their tensors are gone once this block ends
        gc.collect()
        torch.cuda.empty_cache()
        return peak

    def _measure(self, micro_batch: int) -> int:
        cfg = tcfg.for_world(tcfg.with_micro_batch(self.cfg, micro_batch), self.world)
        figures = estimate(cfg, self.model_cfg, self.world, "cuda")
        torch.cuda.reset_peak_memory_stats(self.device)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision, torch.float32)
        model = TRHashForCausalLM(self.model_cfg).to(self.device, dtype)
        model.set_activation_checkpointing(cfg.model.activation_checkpointing, cfg.model.activation_checkpointing_every)
        backend.apply(model, backend.resolve(cfg.kernels.policy, self.device, self.model_cfg, dtype=dtype))
        engine_side = torch.empty(figures.optimizer + figures.buffers, dtype=torch.uint8, device=self.device)
        ids = torch.randint(0, self.model_cfg.vocab_size, (micro_batch, cfg.data.seq_len), device=self.device)
        model(ids, labels=ids, reduction="sum").backward()
        peak = torch.cuda.max_memory_allocated(self.device)
        del model, engine_side, ids
        return peak
