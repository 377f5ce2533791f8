"""Checks of the machine against a stage: devices, precision, memory, disk and packages.

Each check is a plain function returning :class:`Check` results (pass / warn / fail, what was
found, and how to fix a failure). ``ds-trhash preflight`` prints all of them; the trainer runs
the cheap ones at launch, before the model exists (see ``launch_checks``), so a run that
cannot store its checkpoints is refused in seconds instead of failing at its first save.

Test hook: ``DS_TRHASH_TEST_DISK_FREE=<bytes>`` makes :func:`free_bytes` report that many free
bytes on every filesystem, so the tests can provoke a full disk. Unset in real runs.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import resource
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast
from pathlib import Path

import torch
import torch.distributed as dist

from ds_trhash.data.stage import cache_bytes_from, cache_dir_of
from ds_trhash.errors import UserError
from ds_trhash.ranks import is_multi_rank, ranks_on_node
from ds_trhash.model import backend
from ds_trhash.training.checkpoint_plan import CheckpointPlan
from ds_trhash.training.preparation.footprint import GIB, Footprint, estimate, gib

if TYPE_CHECKING:
    from ds_trhash.model.config import TRHashConfig
    from ds_trhash.training.config import TrainConfig

PASS, WARN, FAIL = "pass", "warn", "fail"
DISK_FREE_ENV = "DS_TRHASH_TEST_DISK_FREE"
# Below this share of free memory an estimate that fits is still reported as a warning:
# the estimate leaves out allocator fragmentation and other processes' growth.
MEMORY_MARGIN = 0.9


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass | warn | fail
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL


class ResourceError(UserError, RuntimeError):
    """The machine cannot run this stage as configured; the message says how to fix it."""


# ----------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class Devices:
    kind: str  # "cuda" or "cpu"
    count: int  # CUDA devices (0 on CPU)
    names: tuple[str, ...]
    free: tuple[int, ...]  # free bytes per CUDA device, or host RAM available (one entry) on CPU
    total: tuple[int, ...]


def host_memory() -> tuple[int, int]:
    """(available, total) host RAM in bytes, from /proc/meminfo where it exists."""
    fields: dict[str, int] = {}
    # no /proc/meminfo, or an unreadable line: sysconf below answers instead
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    total = fields.get("MemTotal", pages * size)
    return fields.get("MemAvailable", os.sysconf("SC_AVPHYS_PAGES") * size), total


def probe_devices(only: int | None = None) -> Devices:
    """Every CUDA device of this node (or just device ``only``: a rank asks about its own, so
    it opens no context on its neighbours'), else the host's memory."""
    if torch.cuda.is_available():
        ids = range(torch.cuda.device_count()) if only is None else [only]
        infos = [torch.cuda.mem_get_info(i) for i in ids]
        names = tuple(torch.cuda.get_device_name(i) for i in ids)
        return Devices("cuda", len(ids), names, tuple(f for f, _ in infos), tuple(t for _, t in infos))
    available, total = host_memory()
    return Devices("cpu", 0, (), (available,), (total,))


def default_nproc(devices: Devices) -> int:
    """One process per CUDA device; one CPU process otherwise."""
    return devices.count if devices.kind == "cuda" and devices.count else 1


def check_devices(devices: Devices, nproc: int) -> Check:
    if devices.kind == "cpu":
        return Check("devices", PASS, f"no CUDA device: {nproc} CPU process(es) over gloo")
    if nproc > devices.count:
        return Check("devices", FAIL, f"{nproc} processes asked for, {devices.count} CUDA device(s) here",
                     f"pass --nproc {devices.count} (one process per GPU on this node)")
    names = sorted(set(devices.names))
    return Check("devices", PASS, f"{nproc} of {devices.count} CUDA device(s): {' / '.join(names)}; NCCL")


def check_precision(precision: str, devices: Devices) -> Check:
    """What DeepSpeed's accelerator says it supports here (its own bf16/fp16 switches)."""
    if precision == "fp32":
        return Check("precision", PASS, "fp32")
    try:
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        ok = acc.is_bf16_supported() if precision == "bf16" else acc.is_fp16_supported()
    except Exception as exc:  # DeepSpeed missing or broken: the packages check names it
        return Check("precision", WARN, f"{precision}: cannot ask DeepSpeed ({type(exc).__name__}: {exc})")
    where = "this GPU" if devices.kind == "cuda" else "the DeepSpeed CPU accelerator"
    if ok:
        return Check("precision", PASS, f"{precision} is supported on {where}")
    other = "fp16" if precision == "bf16" and devices.kind == "cuda" else "fp32"
    return Check("precision", FAIL, f"{precision} is not supported on {where}", f"set precision {other}")


def check_memory(footprint: Footprint, devices: Devices, nproc: int) -> Check:
    need = footprint.per_rank
    if devices.kind == "cuda":
        used = range(min(nproc, devices.count))
        short = [i for i in used if need > devices.free[i]]
        tight = [i for i in used if need > MEMORY_MARGIN * devices.free[i]]
        free = min(devices.free[i] for i in used) if used else 0
        where = f"least free CUDA memory {gib(free)} (device {min(used, key=lambda i: devices.free[i])})"
        count = 1
    else:
        count = nproc
        need = nproc * footprint.per_rank
        free = devices.free[0]
        short = [0] if need > free else []
        tight = [0] if need > MEMORY_MARGIN * free else []
        where = f"host RAM available {gib(free)} for {nproc} process(es)"
    detail = f"estimate {gib(need)} ({footprint.describe()}); {where}"
    if short:
        return Check("memory", FAIL, detail,
                     "lower batch.micro_batch (raise batch.grad_accum to keep the batch), use zero.stage 1 or 2, "
                     "bf16, or more devices")
    if tight:
        return Check("memory", WARN, detail + f"; less than {1 - MEMORY_MARGIN:.0%} headroom",
                     "run `ds-trhash smoke` to measure the real peak")
    return Check("memory", PASS, detail)


def peak_memory(device: torch.device) -> dict:
    """This process's peak so far: CUDA memory allocated on ``device``, else the resident set."""
    if device.type == "cuda":
        return {"bytes": int(torch.cuda.max_memory_allocated(device)), "kind": "CUDA allocated, one rank"}
    return {"bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "kind": "host RSS, one rank"}


# ----------------------------------------------------------------------------- disk


def _existing(path: Path) -> Path:
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes for an unprivileged writer on the filesystem that will hold ``path``."""
    forced = os.environ.get(DISK_FREE_ENV)
    if forced:
        return int(forced)
    return shutil.disk_usage(_existing(Path(path))).free


def check_disk(needs: list[tuple[str, Path, int]]) -> list[Check]:
    """``needs``: (what, where, bytes). Needs on one filesystem are added before comparing."""
    by_fs: dict[int, list[tuple[str, Path, int]]] = {}
    for what, where, size in needs:
        by_fs.setdefault(os.stat(_existing(where)).st_dev, []).append((what, where, size))
    checks = []
    for items in by_fs.values():
        where = items[0][1]
        need = sum(size for _, _, size in items)
        free = free_bytes(where)
        detail = f"{gib(free)} free under {_existing(where)}, {gib(need)} needed: " + " + ".join(
            f"{what} {gib(size)}" for what, _, size in items)
        if need > free:
            checks.append(Check("disk", FAIL, detail,
                                "free space there, choose another --output-dir, or keep fewer checkpoints "
                                "(checkpoint.keep_last, checkpoint.packs, checkpoint.every_steps)"))
        else:
            checks.append(Check("disk", PASS, detail))
    return checks


# ----------------------------------------------------------------------------- packages


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_deepspeed() -> Check:
    """DeepSpeed imports (for real), with the versions that will run."""
    err = backend._import_error("deepspeed")
    if err:
        return Check("package deepspeed", FAIL, f"not importable ({err})", "install it: make install (pins deepspeed==0.19.8)")
    return Check("package deepspeed", PASS, f"deepspeed {package_version('deepspeed')}, torch {torch.__version__}")


def kernel_packages(choice: backend.KernelChoice) -> list[Check]:
    """The versions of the kernel packages a resolved ``KernelChoice`` runs (it imported them)."""
    return [Check(f"package {dist}", PASS, f"{dist} {package_version(dist)} (used by this profile)")
            for dist, used in (("triton", choice.experts == "triton"), ("liger-kernel", choice.loss == "liger"))
            if used]


def check_comm_op(devices: Devices) -> Check:
    """NCCL on GPUs; on CPU, plain gloo (nothing to build: ``engine.without_shared_memory_op``)."""
    if devices.kind == "cuda":
        if torch.distributed.is_nccl_available():
            return Check("deepspeed ops", PASS, "NCCL backend available")
        return Check("deepspeed ops", FAIL, "this torch build has no NCCL", "install a CUDA build of torch")
    if not dist.is_gloo_available():
        return Check("deepspeed ops", FAIL, "this torch build has no gloo backend", "install torch from PyPI (make install)")
    return Check("deepspeed ops", PASS, "CPU communication over plain gloo; DeepSpeed's shared-memory op is not "
                 "loaded (training never uses it), so nothing is compiled")


# ----------------------------------------------------------------------------- at launch


def disk_needs(cfg: TrainConfig, footprint: Footprint, total_steps: int, steps_per_epoch: int | None, world: int,
               after: int = 0, existing: list[int] | tuple = ()) -> list[tuple[str, Path, int]]:
    """What a run from step ``after`` to ``total_steps`` puts on disk: the checkpoints it keeps at
    once beyond the ``existing`` complete ones (the trainer's own cadence and rotation), and the
    node's one shard cache (pretraining, refinement: shared by the node's ranks)."""
    kept = CheckpointPlan.for_stage(cfg, total_steps, steps_per_epoch).peak_kept(after=after, existing=existing)
    new = max(0, kept - len(existing))
    needs = [(f"checkpoints ({new} more x {gib(footprint.checkpoint)}, at most {kept} at once)",
              Path(cfg.output_dir), new * footprint.checkpoint)]
    if cfg.data.kind == "pretrain":
        cache_dir = cache_dir_of(cfg.data.cache_dir)
        needs.append(("shard cache (one per node)", cache_dir, cache_bytes_from(cfg.data.cache_gb, os.environ)))
    return needs


def shared_free_bytes(path: str | os.PathLike) -> int:
    """Free bytes under ``path`` as rank 0 measures them, the same number on every rank, so that
    a refusal is unanimous (a single rank refusing would leave the others waiting)."""
    distributed = is_multi_rank()
    value = [free_bytes(path) if not distributed or dist.get_rank() == 0 else None]
    if distributed:
        dist.broadcast_object_list(value, src=0)
    return int(cast(int, value[0]))  # rank 0's number, on every rank


def local_processes(world: int) -> int:
    """Ranks on this node (``ds_trhash.ranks.ranks_on_node``)."""
    return ranks_on_node(world)


def check_at_launch(cfg: TrainConfig, model_cfg: TRHashConfig, world: int, local_processes: int, devices: Devices, total_steps: int,
                    steps_per_epoch: int | None, after: int, existing: list[int], output_free: int) -> list[Check]:
    """The cheap part of preflight's resource checks, run by the trainer before the model exists.

    ``output_free``: free bytes under the output directory, measured once (rank 0) and shared so
    every rank decides alike. Fewer than one checkpoint needs is refused (ResourceError): the
    first save would fail. Less than every checkpoint the run keeps, or memory short of the
    estimate, comes back as warnings to log: the run can still be rescued (pruning, syncing)."""
    footprint = estimate(cfg, model_cfg, world, devices.kind)
    if output_free < footprint.checkpoint:
        raise ResourceError(
            f"{gib(output_free)} free under {_existing(Path(cfg.output_dir))} cannot hold one checkpoint of "
            f"{gib(footprint.checkpoint)}; free space there or choose another --output-dir "
            "(ds-trhash preflight shows what the whole run needs)")
    checks = check_disk(disk_needs(cfg, footprint, total_steps, steps_per_epoch, world, after, existing))
    checks.append(check_memory(footprint, devices, local_processes))
    return [Check(c.name, WARN, c.detail, c.fix) for c in checks if c.status != PASS]


__all__ = ["Check", "Devices", "ResourceError", "PASS", "WARN", "FAIL", "GIB", "probe_devices", "default_nproc",
           "check_devices", "check_precision", "check_memory", "check_disk", "free_bytes", "check_deepspeed", "kernel_packages",
           "check_comm_op", "check_at_launch", "disk_needs", "shared_free_bytes", "local_processes", "package_version", "host_memory", "peak_memory"]
