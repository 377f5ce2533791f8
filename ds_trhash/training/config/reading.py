"""Reading a config: YAML (duplicate keys refused), ``--set`` overrides, and the typed build.

The builder turns the nested mapping into :class:`TrainConfig` and names, on any problem, the
file or override that set the key, the dotted key and what would have been accepted; then the
combination checks run (``checks.py``).
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import MISSING
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypeVar, cast

import yaml

from .checks import _check_combinations
from .schema import ConfigError, TrainConfig

T = TypeVar("T")

class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``3e-4`` as a float.

    PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent, so ``lr: 3e-4``
    would silently be the string "3e-4". Learning rates are written that way all the time.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice; YAML would silently keep the last one."""


def _construct_unique_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: SafeLoader reports it below
            continue
        if first is not None:
            raise DuplicateKeyError(f"duplicate key {key!r} on line {first} and line {line}; "
                                    "YAML keeps only the last, so remove one of them")
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _yaml_load(text: str) -> object:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 -- a SafeLoader subclass


def _schema_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: object) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_type_name(args[0])}"
        return f"a list of {len(args)} {_type_name(args[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    names: dict[object, str] = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
                                dict: "a mapping"}
    return names.get(tp, str(tp))


# Keys that existed once: a config still carrying one gets told what replaced it.
REMOVED_KEYS = {
    "training.eval_every_epoch": "removed: held-out evaluation runs at step 0 and at every epoch end "
                                 "whenever eval.heldout is true; delete the key (eval.heldout false turns it off)",
}


class _Builder:
    """Turns a nested mapping into TrainConfig, remembering where each key was set."""

    def __init__(self, source: str, key_sources: Mapping[str, str]):
        self.source = source
        self.key_sources = dict(key_sources)

    def where(self, key: str) -> str:
        """The override that set ``key`` (or a section above it), else the file."""
        parts = key.split(".")
        for i in range(len(parts), 0, -1):
            hit = self.key_sources.get(".".join(parts[:i]))
            if hit:
                return hit
        return self.source

    def fail(self, key: str, problem: str, *related: str) -> ConfigError:
        """An error at ``key``; ``related`` keys of a combination add their sources when they differ."""
        sources: list[str] = []
        for k in (key, *related):
            if self.where(k) not in sources:
                sources.append(self.where(k))
        return ConfigError(" + ".join(sources), key, problem)

    def build(self, cls: type[T], raw: object, prefix: str) -> T:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise self.fail(prefix or "<top level>", f"expected a mapping, got {type(raw).__name__} {raw!r}")
        fields = _schema_fields(cls)
        hints = _hints(cls)
        for key in raw:
            if key not in fields:
                full = f"{prefix}.{key}" if prefix else str(key)
                if full in REMOVED_KEYS:
                    raise self.fail(full, REMOVED_KEYS[full])
                raise self.fail(full, f"unknown key; allowed keys: {', '.join(sorted(fields))}")
        values = {}
        for name, f in fields.items():
            full = f"{prefix}.{name}" if prefix else name
            tp = hints[name]
            if name in raw:
                value = self.convert(tp, raw[name], full)
            elif dataclasses.is_dataclass(tp):
                value = self.build(cast(type, tp), {}, full)
            elif f.default is MISSING and f.default_factory is MISSING:
                raise self.fail(full, f"missing required field; expected {_type_name(tp)}")
            else:
                continue
            check = f.metadata.get("check")
            problem = check(value) if check else None
            if problem:
                raise self.fail(full, problem)
            values[name] = value
        return cls(**values)

    def _number_or_word(self, inner: list[Any], value: object, key: str) -> object:
        """``int | Literal["auto"]`` (batch.micro_batch): a number, or one of the words."""
        words = typing.get_args(inner[1])
        if value in words and isinstance(value, str):
            return value
        if isinstance(value, inner[0]) and not isinstance(value, bool):
            return value
        got = "null" if value is None else f"{type(value).__name__} {value!r}"
        raise self.fail(key, f"expected {_type_name(inner[0])} or {', '.join(map(repr, words))}, got {got}")

    def convert(self, tp: object, value: object, key: str, nullable: bool = False) -> object:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        orr = " or null" if nullable else ""
        got = "null" if value is None else f"{type(value).__name__} {value!r}"
        if dataclasses.is_dataclass(tp):
            return self.build(cast(type, tp), value, key)
        if origin is Literal:
            for allowed in args:
                if type(value) is type(allowed) and value == allowed:
                    return value
            shown = ", ".join(str(a) for a in args) + (", null" if nullable else "")
            raise self.fail(key, f"got {'null' if value is None else repr(value)}; allowed values: {shown}")
        if origin in (typing.Union, types.UnionType):
            inner = [a for a in args if a is not type(None)]
            if len(inner) == 2 and typing.get_origin(inner[1]) is Literal and len(args) == 2:
                return self._number_or_word(inner, value, key)
            if len(inner) != 1 or len(args) != 2:
                raise TypeError(f"schema union {tp} not supported")  # a bug in this file, not the config
            return None if value is None else self.convert(inner[0], value, key, nullable=True)
        if origin is tuple:
            if isinstance(value, str) and "," in value:  # "10,12" (--set profile.steps=10,12) is [10, 12]
                value = [_yaml_load(part) for part in value.split(",")]
            if not isinstance(value, (list, tuple)):
                raise self.fail(key, f"expected {_type_name(tp)}{orr}, got {got}")
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(self.convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
            if len(value) != len(args):
                raise self.fail(key, f"expected {_type_name(tp)}, got {len(value)} item(s) {list(value)!r}")
            return tuple(self.convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        if tp is dict:
            if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
                return _deep_copy(value)
            raise self.fail(key, f"expected a mapping of DeepSpeed config keys, got {got}")
        if tp is bool:
            if isinstance(value, bool):
                return value
        elif tp is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif tp is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if math.isfinite(value):
                    return float(value)
                raise self.fail(key, f"must be finite, got {value!r}")
        elif tp is str:
            if isinstance(value, str) and value:
                return value
            if isinstance(value, str):
                raise self.fail(key, "must not be empty" + (" (use null for none)" if nullable else ""))
        else:
            raise TypeError(f"schema type {tp} not supported")  # a bug in this file, not the config
        raise self.fail(key, f"expected {_type_name(tp)}{orr}, got {got}")


def _set_path(raw: dict, dotted: str, value: object, label: str) -> None:
    """Place an override into the raw mapping, refusing keys the schema does not have."""
    cls: type = TrainConfig
    node = raw
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = _schema_fields(cls)
        if part not in fields:
            if dotted in REMOVED_KEYS:
                raise ConfigError(label, dotted, REMOVED_KEYS[dotted])
            done = ".".join(parts[:i]) or "<top level>"
            raise ConfigError(label, dotted, f"unknown key; allowed keys under {done}: {', '.join(sorted(fields))}")
        tp = _hints(cls)[part]
        if tp is dict:  # a free-form section (deepspeed): the rest of the path is its keys
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = _copied(child) if isinstance(child, Mapping) else {}
            node = child
            rest = parts[i + 1:]
            if not rest:
                if not isinstance(value, Mapping):
                    raise ConfigError(label, dotted, f"expected a mapping, got {value!r}")
                _deep_merge(node, value)
                return
            for sub in rest[:-1]:
                child = node.get(sub)
                if not isinstance(child, dict):
                    child = node[sub] = {}
                node = child
            node[rest[-1]] = value
            return
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp) and isinstance(value, Mapping) and isinstance(node.get(part), Mapping):
                node[part] = {**node[part], **value}
            else:
                node[part] = value
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(label, dotted, f"{'.'.join(parts[: i + 1])} is not a section")
        child = node.get(part)
        if not isinstance(child, dict):
            child = {} if child is None or not isinstance(child, Mapping) else dict(child)
            node[part] = child
        node = child
        cls = cast(type, tp)


def config_from_dict(raw: object, source: str = "<dict>", overrides: Sequence[str] = ()) -> TrainConfig:
    """Validate a mapping (a parsed YAML document) plus ``a.b=v`` overrides."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(source, "", f"the document must be a mapping of sections, got {type(raw).__name__}")
    raw = _copied(raw)
    key_sources: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item}", "", "expected KEY=VALUE, e.g. --set optimizer.lr=3.0e-4")
        dotted, text = item.split("=", 1)
        dotted = dotted.strip()
        label = f"--set {dotted}"
        try:
            value = _yaml_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(label, dotted, f"value {text!r} is not valid YAML: {err}") from None
        _set_path(raw, dotted, value, label)
        key_sources[dotted] = label
    b = _Builder(source, key_sources)
    cfg = b.build(TrainConfig, raw, "")
    origin = source if not overrides else f"{source} with {', '.join('--set ' + o for o in overrides)}"
    cfg = dataclasses.replace(cfg, origin=origin)
    _check_combinations(cfg, b)
    return cfg


def _deep_merge(into: dict, extra: Mapping) -> dict:
    """Merge ``extra`` into ``into`` key by key, mappings recursively; returns ``into``."""
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = _deep_copy(v)
    return into


def _copied(raw: Mapping) -> dict:
    return {k: _deep_copy(v) for k, v in raw.items()}


def _deep_copy(raw: object) -> object:
    if isinstance(raw, Mapping):
        return _copied(raw)
    if isinstance(raw, list):
        return [_deep_copy(v) for v in raw]
    return raw


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML training config and apply ``--set`` overrides; raises ConfigError."""
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(path, "", f"cannot read config file: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(path, "", f"not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                                    "save the config as UTF-8") from None
    try:
        raw = _yaml_load(text)
    except DuplicateKeyError as err:
        raise ConfigError(path, "", str(err)) from None
    except yaml.YAMLError as err:
        raise ConfigError(path, "", f"not valid YAML: {err}") from None
    return config_from_dict(raw, source=path, overrides=overrides)
