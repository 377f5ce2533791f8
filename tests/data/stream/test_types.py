"""The stream's shared names are declared once, in ``data/stream/types.py``."""
import ast
from pathlib import Path

from ds_trhash.data.stream.cache import fetch_worker, fetcher, prefetch, shard_cache
from ds_trhash.data.stream.corpus import opening
from ds_trhash.data.stream.delivery import reader, working_set
from ds_trhash.data.stream.order import horizon
from ds_trhash.data.stream.delivery.exchange import nodes, rows
from ds_trhash.data.stream.types import Key

STREAM = Path(__file__).resolve().parents[3] / "ds_trhash" / "data" / "stream"


def _declares_key(text: str) -> bool:
    """Whether a module assigns ``Key`` itself at its top level (an import does not count)."""
    for node in ast.parse(text).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(getattr(t, "id", None) == "Key" for t in targets):
            return True
    return False


def test_key_is_declared_once():
    declared = sorted(str(p.relative_to(STREAM)) for p in STREAM.rglob("*.py")
                      if _declares_key(p.read_text(encoding="utf-8")))
    assert declared == ["types.py"], f"import Key from ds_trhash.data.stream.types: {declared}"
    # the scan itself: a declaration is seen, an import is not
    assert _declares_key("Key = tuple[str, str]\n") and _declares_key("Key: type = tuple\n")
    assert not _declares_key("from ds_trhash.data.stream.types import Key\n")


def test_the_modules_share_the_one_key():
    assert Key == tuple[str, str]
    for module in (shard_cache, prefetch, fetch_worker, fetcher, horizon, opening, reader, working_set, nodes, rows):
        assert module.Key is Key, module.__name__
