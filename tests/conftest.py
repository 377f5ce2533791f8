"""Test-wide set-up that must happen before triton is imported anywhere."""
import os
import shutil
import subprocess
from pathlib import Path

# Triton kernels (ours and Liger's) run on CPU only in the interpreter, and the switch is read
# when triton is first imported, so it is set here, before any test module imports it.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under `make test` two xdist workers share the CI machine's two cores with the launches they
# start (which run with OMP_NUM_THREADS=1): one intra-op thread per worker, set before torch is
# imported, avoids oversubscription (about 28 % faster for the in-process model and data tests).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# No test reaches the real Hugging Face Hub: a test that wants a Hub points HF_ENDPOINT at the
# loopback stand-in (tests/release/hub_server.py); anything else meets a closed loopback port and
# fails at once instead of waiting on the network. Set before huggingface_hub is imported.
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"

os.environ.pop("HF_TOKEN", None)
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The venv's bin comes first on PATH: the `deepspeed` launcher and the `ds-trhash` commands the
# tests start are the venv's.
_VENV_BIN = os.path.dirname(os.path.abspath(__import__("sys").executable))
if not os.environ.get("PATH", "").startswith(_VENV_BIN + os.pathsep):
    os.environ["PATH"] = _VENV_BIN + os.pathsep + os.environ.get("PATH", "")

import pytest  # noqa: E402

# the small BPE tokenizer shared by the SFT, eval and batching tests (session-scoped fixtures)
from tests.data.sft_fixtures import tokenizer, tokenizer_dir  # noqa: E402,F401


@pytest.fixture(scope="session", autouse=True)
def _default_shard_cache(tmp_path_factory):
    """The default shard cache is node-local scratch shared by every launch of the machine; each
    xdist worker's launches get one of their own (under its own temporary folder), so that workers
    running side by side never evict each other's shards or count them against their bounds (a
    test that checks a cache names its own ``data.cache_dir``)."""
    os.environ["DS_TRHASH_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "default-shard-cache")
    yield


@pytest.fixture(scope="session")
def shared_launches(tmp_path_factory):
    """Reference launches shared across modules (the 2-process ZeRO-1 run that exact resume and
    --reshard both compare against is launched once, not once per module or per xdist worker)."""
    from tests.training.launch_utils import SharedLaunches

    return SharedLaunches(shared_session_dir(tmp_path_factory) / "shared-launches")


def shared_session_dir(tmp_path_factory) -> Path:
    """A folder of this test session that every xdist worker sees: the controller's base
    temporary directory, which holds each worker's own (popen-gw0, popen-gw1, ...)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# ----------------------------------------------------------------------------- the e2e marker
# `make test-fast` runs `-m "not e2e"`: every test that starts a training launch must carry
# @pytest.mark.e2e (pytest.ini), or the fast loop would start one. So that the marker stays
# true, a test without it (and the fixtures it sets up) cannot start one: any process whose
# command line is a launch fails the test, in every run of the suite.

_LAUNCH_MARKED = {"now": True}  # whether the test being set up, run or torn down carries the marker


def starts_a_launch(argv) -> bool:
    """Whether a command line starts training: the deepspeed launcher, launch/train.py, or a
    ds-trhash command that launches (smoke, jobs up)."""
    words = [str(argv)] if isinstance(argv, (str, bytes, os.PathLike)) else [str(a) for a in argv]
    if len(words) == 1:
        words = words[0].split()
    names = [os.path.basename(w) for w in words]
    if "deepspeed" in names or any(w.endswith(os.path.join("launch", "train.py")) for w in words):
        return True
    cli = "ds-trhash" in names or "ds_trhash.cli" in words
    return cli and ("smoke" in words or ("jobs" in words and "up" in words))


def _guarded_popen_init(original):
    def init(self, args, *rest, **kwargs):
        if not _LAUNCH_MARKED["now"] and starts_a_launch(args):
            raise AssertionError(f"this test starts a training launch ({' '.join(map(str, args))[:200]}) but is not "
                                 "marked @pytest.mark.e2e (make test-fast would run it)")
        original(self, args, *rest, **kwargs)

    return init


def pytest_configure(config):
    subprocess.Popen.__init__ = _guarded_popen_init(subprocess.Popen.__init__)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before the item's fixtures are set up: a module or session fixture that launches belongs to it
    _LAUNCH_MARKED["now"] = item.get_closest_marker("e2e") is not None


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile``, a work unit is tests/schedule.py's unit: a whole file, or the
    files that read one launching session fixture. (xdist's own ``loadgroup`` would need a
    mark per test and does not group here: the test ids it suffixes are rebuilt by pytest.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    from tests.schedule import FIRST, unit_of

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid.split("::", 1)[0])  # a test id starts with its file, from the root

        def _assign_work_unit(self, node) -> None:
            # the next unit a worker takes: the first of FIRST still waiting, else xdist's next
            waiting = next((unit for unit in FIRST if unit in self.workqueue), None)
            if waiting is not None:
                self.workqueue.move_to_end(waiting, last=False)
            super()._assign_work_unit(node)

    return UnitScheduling(config, log)


def pytest_sessionstart(session):
    """Say up front when earlier DeepSpeed launches left shared-memory segments in /dev/shm.

    They are RAM that nothing frees; enough of them swap the machine to a halt and the suite then
    times out with no error to read. The trainer makes none (it starts DeepSpeed without its
    shared-memory op: engine.without_shared_memory_op), so these come from launches outside it."""
    import glob

    stale = glob.glob("/dev/shm/deepspeed_allreduce_buffer_*")
    if not stale:
        return
    size = sum(os.path.getsize(p) for p in stale if os.path.exists(p)) / 2**30
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"warning: {len(stale)} DeepSpeed shared-memory segments ({size:.1f} GiB of RAM) left in /dev/shm "
            "by earlier launches; when no run is starting, free them with: rm /dev/shm/deepspeed_allreduce_buffer_*",
            yellow=True,
        )
