"""The ``deepspeed:`` section of a stage config: DeepSpeed's own options, merged into ours.

The trainer generates the DeepSpeed config from the stage contract (batch sizes, precision,
clipping, ZeRO stage; the optimizer and scheduler are client objects). Everything else DeepSpeed
offers -- monitors, profilers, the comms logger, ZeRO tuning and offload, timers -- is written in
the YAML under ``deepspeed:`` (or ``--set deepspeed.x.y=...``) and deep-merged into that
generated dict. Three rules keep it honest:

* keys the contract owns are refused there, naming the YAML key that sets them; ``"auto"`` is
  accepted for them (as in the Hugging Face Trainer's DeepSpeed integration) and means "ours";
* a key DeepSpeed does not read is refused: the merged dict goes through ``DeepSpeedConfig``
  (whose pydantic models reject unknown nested keys with their own message), and the lookups
  DeepSpeed made are recorded, so a top-level or nested key it never looked at is named too;
* settings that can change the trained trajectory are training-critical (an exact resume must
  match them); pure observers -- monitors, profilers, timers, logging -- are not.
"""
from __future__ import annotations

import collections.abc
import copy
from typing import Any, Mapping

from ds_trhash.batch_layout import step_rows
from ds_trhash.training.records.files import MONITORS_DIR

__all__ = ["OWNED", "OBSERVERS", "owned_problems", "merge", "deepspeed_problem", "critical_items",
           "with_monitor_defaults", "features_on", "MONITORS"]

# DeepSpeed key (dotted) -> the stage-config key that owns it.
OWNED = {
    "train_batch_size": "batch.global_tokens",
    "train_micro_batch_size_per_gpu": "batch.micro_batch",
    "gradient_accumulation_steps": "batch.global_tokens (grad_accum is derived from it)",
    "gradient_clipping": "optimizer.grad_clip",
    "bf16.enabled": "precision",
    "bfloat16.enabled": "precision",
    "fp16.enabled": "precision",
    "torch_autocast": "precision",
    "zero_optimization.stage": "zero.stage",
    "optimizer": "optimizer (lr, betas, eps, weight_decay, torch_adam)",
    "scheduler": "schedule",
    "checkpoint.load_universal": "--reshard",
    "activation_checkpointing": "model.activation_checkpointing (the model recomputes its decoder layers itself)",
}
# Top-level keys that only watch the run; everything else may change the trajectory.
MONITORS = ("tensorboard", "csv_monitor", "wandb", "comet")
OBSERVERS = frozenset(MONITORS + ("flops_profiler", "comms_logger", "wall_clock_breakdown", "memory_breakdown",
                                  "steps_per_print", "timers", "dump_state", "log_level"))


def _leaves(section: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in section.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_leaves(v, path + "."))
        else:
            out[path] = v
    return out


def _owner(path: str) -> str | None:
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        hit = OWNED.get(".".join(parts[:i]))
        if hit:
            return hit
    return None


def owned_problems(section: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(deepspeed.<key>, problem) for each contract-owned key set to anything but "auto"."""
    out = []
    for path, value in _leaves(section).items():
        owner = _owner(path)
        if owner and value != "auto":
            out.append((f"deepspeed.{path}", f"owned by the stage config; set {owner} instead "
                                             "(or write \"auto\" here to take the config's value)"))
    return out


def _without_auto(section: Mapping[str, Any]) -> dict:
    out: dict[str, Any] = {}
    for k, v in section.items():
        if isinstance(v, Mapping):
            inner = _without_auto(v)
            if inner or not v:
                out[k] = inner
        elif v != "auto":
            out[k] = v
    return out


def merge(generated: dict, section: Mapping[str, Any]) -> dict:
    """``generated`` with the user's section deep-merged in ("auto" entries left to ours)."""
    def into(base: dict, extra: Mapping) -> dict:
        out = dict(base)
        for k, v in extra.items():
            out[k] = into(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
        return out

    return into(generated, _without_auto(section))


class _Tracked(dict):
    """A config dict that records which keys DeepSpeed looked up."""

    def __init__(self, data: Mapping, seen: set[tuple[str, ...]], path: tuple[str, ...] = ()) -> None:
        super().__init__(data)
        self._seen, self._path = seen, path

    def _child(self, key: str, value: object) -> object:
        if isinstance(value, Mapping) and not isinstance(value, _Tracked):
            value = _Tracked(value, self._seen, self._path + (key,))
        return value

    def _note(self, key: str) -> None:
        self._seen.add(self._path + (key,))

    def __getitem__(self, key: str) -> object:
        self._note(key)
        return self._child(key, super().__getitem__(key))

    def get(self, key: str, default: object = None) -> object:
        self._note(key)
        return self._child(key, super().get(key, default))

    def __contains__(self, key: object) -> bool:
        self._note(str(key))
        return super().__contains__(key)

    def keys(self) -> collections.abc.KeysView:  # type: ignore[override]  # ``key in d.keys()`` is a lookup too
        outer = self

        class Keys(collections.abc.KeysView):
            def __contains__(self, key: object) -> bool:
                outer._note(str(key))
                return dict.__contains__(outer, key)

        return Keys(self)

    def __copy__(self) -> _Tracked:
        return _Tracked(self, self._seen, self._path)


_PROBE = "ds_trhash_probe_key"


def _read_config(merged: dict, seen: set | None = None) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    DeepSpeedConfig(_Tracked(merged, seen if seen is not None else set()))


def _strict(merged: dict, parent: tuple) -> bool:
    """Whether DeepSpeed validates the mapping at ``parent`` whole (a pydantic model that forbids
    extra keys): then a key it did not look up one by one was still checked, and accepted."""
    if not parent:
        return False
    probe = copy.deepcopy(merged)
    node = probe
    for part in parent:
        node = node[part]
    node[_PROBE] = True
    try:
        _read_config(probe)
    except Exception as err:  # noqa: BLE001 -- any refusal that names the probe key
        return _PROBE in str(err)
    return False


def _first_line(err: BaseException) -> str:
    lines = [ln for ln in str(err).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
    return " / ".join(ln.strip() for ln in lines) or type(err).__name__


def deepspeed_problem(merged: dict, section: Mapping[str, Any]) -> tuple[str, str] | None:
    """Run DeepSpeed's own config reader over ``merged``: (deepspeed.<key>, message) or None.

    ``train_batch_size`` is rendered for the world size DeepSpeed sees here (one process before
    torch.distributed starts), since DeepSpeedConfig checks the batch keys against it.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    merged = dict(merged, train_batch_size=step_rows(merged["train_micro_batch_size_per_gpu"],
                                                     merged["gradient_accumulation_steps"], world))
    seen: set = set()
    leaves = list(_leaves(section))
    try:
        _read_config(merged, seen)
    except Exception as err:  # noqa: BLE001 -- DeepSpeed raises pydantic, assertion and its own errors alike
        text = _first_line(err)
        named = [p for p in leaves if p.split(".")[-1] in text]  # the key the message is about
        key = f"deepspeed.{max(named, key=len)}" if named else "deepspeed"
        return key, f"DeepSpeed refuses it: {text}"
    for path in leaves:
        parts = tuple(path.split("."))
        unread = next((parts[:i] for i in range(1, len(parts) + 1) if parts[:i] not in seen), None)
        if unread and not _strict(merged, unread[:-1]):
            return (f"deepspeed.{path}", f"DeepSpeed's config reader does not know {'.'.join(unread)!r} "
                                         "(DeepSpeedConfig never looks it up); check the spelling against the "
                                         "DeepSpeed config documentation")
    return None


def critical_items(section: Mapping[str, Any]) -> dict[str, Any]:
    """The user's settings that can change the trajectory, as ``{"deepspeed.a.b": value}``."""
    return {f"deepspeed.{p}": (list(v) if isinstance(v, tuple) else v) for p, v in _leaves(_without_auto(section)).items()
            if p.split(".")[0] not in OBSERVERS}


def with_monitor_defaults(section: Mapping[str, Any], output_dir: str, job_name: str) -> dict:
    """Enabled monitors without an ``output_path`` write under ``<output_dir>/monitors``."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in section.items()}
    for name in MONITORS:
        mon = out.get(name)
        if isinstance(mon, dict) and mon.get("enabled") and name != "comet":
            if name != "wandb":
                mon.setdefault("output_path", f"{output_dir}/{MONITORS_DIR}")
                mon.setdefault("job_name", job_name)
    return out


def features_on(merged: Mapping[str, Any]) -> list[str]:
    """DeepSpeed features this launch turns on, for the startup summary."""
    on = [name for name in MONITORS + ("flops_profiler", "comms_logger")
          if isinstance(merged.get(name), Mapping) and merged[name].get("enabled")]
    on += [name for name in ("wall_clock_breakdown", "memory_breakdown") if merged.get(name) is True]
    zero = merged.get("zero_optimization") or {}
    on += [f"zero_optimization.{k}" for k, v in zero.items()
           if k != "stage" and v not in (None, False, {}) and not (isinstance(v, Mapping) and v.get("device") == "none")]
    return on
