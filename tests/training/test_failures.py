"""How a failed launch's exception is recognised: a disk that cannot take the run's files, a
collective that failed because another rank is gone."""

import errno
import io

import torch
import torch.distributed as dist

from ds_trhash.training import failures


def _raised(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 (the test inspects what was raised)
        return exc
    raise AssertionError("nothing was raised")


class _FullDisk(io.RawIOBase):
    def writable(self):
        return True

    def write(self, b):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_disk_is_recognised_by_errno_and_origin_not_by_its_words(tmp_path):
    full = _raised(lambda: torch.save({"w": torch.zeros(64)}, _FullDisk()))
    assert failures.disk_failure(full, str(tmp_path)) == "no space left on the device"
    read_only = OSError(errno.EROFS, "Read-only file system", str(tmp_path / "checkpoints" / "step_2.tmp"))
    assert failures.disk_failure(read_only, str(tmp_path)) == (
        f"the file system is read-only writing {tmp_path / 'checkpoints' / 'step_2.tmp'}")
    # a cause further down the chain counts; a missing file or a bug does not, whatever it says
    wrapped = _raised(lambda: _reraise(RuntimeError("saving failed"), OSError(errno.EDQUOT, "quota")))
    assert failures.disk_failure(wrapped, str(tmp_path)) == "the disk quota is exceeded"
    assert failures.disk_failure(OSError(errno.ENOENT, "No such file", "x"), str(tmp_path)) is None
    assert failures.disk_failure(RuntimeError("file write failed: no space left"), str(tmp_path)) is None
    shape_bug = _raised(lambda: torch.zeros(2) @ torch.zeros(3))  # raised inside torch, not its writer
    assert failures.disk_failure(shape_bug, str(tmp_path)) is None


def _reraise(outer, inner):
    try:
        raise inner
    except OSError:
        raise outer from inner


def test_a_lost_rank_is_recognised_by_type_and_origin_not_by_the_word_gloo():
    assert failures.peer_lost(dist.DistNetworkError("connection reset"), world=2)
    assert not failures.peer_lost(RuntimeError("gloo: Connection closed by peer"), world=2)
    assert not failures.peer_lost(ValueError("bad value"), world=2)
