"""Shared pieces of the checkpoint tests: a trainer state, a fake engine writer, a log sink, and
checkpoints whose records agree (or are made to disagree) for the consistency tests."""
import torch

from ds_trhash import checkpoints as ck
from ds_trhash.checkpoints import TrainerState
from ds_trhash.checkpoints.save import save_checkpoint

CRITICAL = {"data.seq_len": 128, "optimizer.lr": 2e-5, "optimizer.betas": [0.9, 0.95], "training.epochs": 3}


def state(step, world_size=1, **over):
    fields = dict(stage="pretraining", step=step, epoch=0, data_cursor=step * 8, world_size=world_size,
                  training_critical=dict(CRITICAL), plan_fingerprint="f" * 64, plan_sha256="a" * 64,
                  backends_used={"experts": "pytorch"}, lora=False, family="language",
                  framework_commit="test")
    fields.update(over)
    return TrainerState(**fields)


def fake_engine(payload=b"engine-bytes"):
    def write(tmp):
        (tmp / "state").mkdir(exist_ok=True)
        (tmp / "state" / "mp_rank_00_model_states.pt").write_bytes(payload)
        (tmp / "latest").write_text("state")
    return write


def save(out, step, **kw):
    kw.setdefault("write_engine_state", fake_engine())
    kw.setdefault("trainer_state", state(step))
    return save_checkpoint(out, step, rank=0, world_size=kw.pop("world_size", 1), **kw)


def messages():
    lines = []
    return lines, lines.append


ROWS, SEQ = 8, 128  # micro_batch 4 x grad_accum 2 x 1 rank, tokens per row
LAYOUT = {**CRITICAL, "batch.micro_batch": 4, "batch.grad_accum": 2, "data.kind": "pretrain"}


def engine(step, *, samples=None, schedule=None, skipped=0):
    """A DeepSpeed model-states record as the engine saves it (without weights)."""
    def write(tmp):
        (tmp / "state").mkdir(exist_ok=True)
        torch.save({"module": {}, "global_steps": step, "global_samples": step * ROWS if samples is None else samples,
                    "skipped_steps": skipped, "lr_scheduler": {"last_epoch": step - skipped if schedule is None else schedule}},
                   tmp / "state" / "mp_rank_00_model_states.pt")
    return write


def consistent(at, **over):
    """The trainer state of step ``at`` whose counters agree; ``over`` changes fields after."""
    fields = dict(data_cursor=at * ROWS, training_critical=dict(LAYOUT))
    return {**state(at, **fields).to_dict(), "total_steps": 100, "tokens_seen": at * ROWS * SEQ,
            "supervised_seen": at * ROWS * SEQ, **over}


def save_as(out, folder_step, doc, write_engine):
    """A checkpoint saved (and sealed) for ``doc``'s step, then published under ``folder_step``'s name."""
    made = save(out / "forge", doc["step"], trainer_state=doc, write_engine_state=write_engine)
    target = ck.checkpoints_root(out) / ck.step_dir_name(folder_step)
    target.parent.mkdir(parents=True, exist_ok=True)
    made.rename(target)
    return target
