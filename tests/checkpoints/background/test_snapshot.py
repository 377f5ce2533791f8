"""The host copy a background save writes (checkpoints/background/snapshot.py): the values of the save's
step, the storage layout torch.save would have written, containers and objects copied."""
import io
from collections import OrderedDict

import torch

from ds_trhash.checkpoints.background import host_snapshot


class Scaler:
    def __init__(self):
        self.cur_scale = 1024.0


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_the_copy_keeps_the_values_of_its_step_and_the_layout_of_a_direct_save():
    flat = torch.arange(20, dtype=torch.float32)  # a flattened group: parameters are views of it
    scaler = Scaler()
    state = OrderedDict(module=OrderedDict(a=flat[:10].view(2, 5), b=flat[10:]),
                        master=torch.nn.Parameter(torch.ones(3)), half=torch.ones(6, dtype=torch.bfloat16)[2:],
                        shapes=[torch.Size([2, 5])], betas=(0.9, 0.95), scaler=scaler, empty=torch.empty(0))
    direct = _saved(state)
    snap, nbytes = host_snapshot(state)
    assert nbytes == 20 * 4 + 3 * 4 + 6 * 2  # each storage once, the flat group whole
    flat.add_(100)  # training goes on, in place
    scaler.cur_scale = 512.0
    assert torch.equal(snap["module"]["b"], torch.arange(10, 20, dtype=torch.float32))
    assert snap["scaler"].cur_scale == 1024.0 and type(snap["module"]) is OrderedDict
    a, b = snap["module"]["a"], snap["module"]["b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and b.storage_offset() == 10
    assert isinstance(snap["master"], torch.nn.Parameter) and snap["master"].requires_grad
    flat.sub_(100)
    scaler.cur_scale = 1024.0
    assert len(_saved(snap)) == len(direct)  # same storages, same records
    loaded = torch.load(io.BytesIO(_saved(snap)), weights_only=False)
    assert torch.equal(loaded["half"], torch.ones(4, dtype=torch.bfloat16)) and loaded["betas"] == (0.9, 0.95)
