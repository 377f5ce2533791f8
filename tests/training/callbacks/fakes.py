"""Small stand-ins for what a launch gives its callbacks: a config, progress, a model, a run."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ds_trhash.training.callbacks import Callback, RunContext
from ds_trhash.data.stage import DataLoader
from ds_trhash.training.loop import TrainState


def config(kind="pretrain", every_steps=0, keep_last=0, log_every=10, select="min_eval_loss", piqa=None,
           keep_unsynced=False):
    return SimpleNamespace(
        data=SimpleNamespace(kind=kind), training=SimpleNamespace(log_every=log_every),
        checkpoint=SimpleNamespace(every_steps=every_steps, keep_last=keep_last, keep_unsynced=keep_unsynced),
        eval=SimpleNamespace(select=select, piqa=piqa))


class Progress:
    def __init__(self):
        self.updates, self.messages, self.closed = [], [], False

    def update(self, step, loss, lr, tok_s, backends=None, extra=None):
        self.updates.append((step, loss, lr, tok_s, backends, extra))

    def message(self, text):
        self.messages.append(text)

    def close(self):
        self.closed = True


class Model:
    """``backends_used()`` says what the last forward ran; ``forward(kind)`` stands for one."""

    def __init__(self):
        self.last = {"experts": "pytorch", "loss": "chunked", "norm": "pytorch"}

    def forward(self, kind):
        self.last = {"experts": "pytorch", "loss": "chunked" if kind == "train" else None, "norm": kind}

    def backends_used(self):
        return dict(self.last)


class Loader(DataLoader):
    """Epochs of ``per_epoch`` steps (no batches: the callbacks never read one); ``figures``: what
    the stream's figures would say (default: nothing streamed)."""

    def __init__(self, per_epoch=100, figures=None):
        self.per_epoch, self._figures = per_epoch, figures

    def micro_batches(self, step):
        raise AssertionError("a callback read the stage's batches")

    def epoch_of(self, step):
        return step // self.per_epoch

    def cursor(self, step):
        return step

    @property
    def steps_per_epoch(self):
        return self.per_epoch

    def figures(self):
        return self._figures() if self._figures is not None else None


def metrics(step, loss=2.0, epoch=0):
    return {"step": step, "epoch": epoch, "loss": loss, "lr": 1e-3, "tok_s": 100.0, "tokens_seen": 8 * step,
            "supervised_tokens": 8, "label_valid": 8, "label_ignored": 0, "label_out_of_range": 0}


def trainer_state(st: TrainState, reason: str, extra: dict) -> dict:
    return {"stage": "pretraining", "step": st.step, "epoch": st.epochs_done, "data_cursor": st.step, "world_size": 1,
            "training_critical": {}, "plan_fingerprint": None, "plan_sha256": None, "backends_used": {},
            "lora": False, "family": "language", "framework_commit": "test", "reason": reason, **extra}


class Engine:
    """DeepSpeed's save_checkpoint, as far as the checkpoint store sees it: files under tag/."""

    def __init__(self):
        self.saves = []

    def save_checkpoint(self, path, tag):
        (Path(path) / tag).mkdir(parents=True, exist_ok=True)
        (Path(path) / tag / "mp_rank_00_model_states.pt").write_bytes(b"weights")
        self.saves.append(tag)


def run(tmp_path, cfg=None, **over) -> RunContext:
    fields = dict(cfg=cfg or config(), rank=0, world=1, output_dir=Path(tmp_path), device="cpu", engine=Engine(),
                  model=Model(), model_config=None, loader=Loader(), progress=Progress(), writer=None,
                  trainer_state=trainer_state)
    fields.update(over)
    return RunContext(**fields)


class Told(Callback):
    """Records what the other callbacks of a run tell every callback: checkpoints saved, results."""

    def __init__(self):
        self.saved, self.evaluated = [], []

    def on_checkpoint_saved(self, step, path):
        self.saved.append((step, path))

    def on_evaluated(self, state, result):
        self.evaluated.append(result)


def told(run: RunContext) -> Told:
    """A ``Told`` among ``run``'s callbacks."""
    listener = Told()
    run.callbacks.append(listener)
    return listener
