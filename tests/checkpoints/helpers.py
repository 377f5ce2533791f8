"""Shared pieces of the checkpoint tests: a trainer state, a fake engine writer, a log sink."""
from ds_trhash.checkpoints import TrainerState, save_checkpoint

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
