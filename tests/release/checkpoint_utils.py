"""A real (verified, single-rank) training checkpoint holding a given state dict."""
import torch

from ds_trhash.checkpoints.save import save_checkpoint


def write_checkpoint(out, cfg, state, *, lora=False, tokenizer_dir=None, stage="supervised-finetuning",
                     critical=None, tokenizer_sha256=None):
    def engine(tmp):
        (tmp / "state").mkdir()
        torch.save({"module": state}, tmp / "state" / "mp_rank_00_model_states.pt")

    doc = dict(stage=stage, step=7, epoch=1, data_cursor=0, world_size=1, training_critical=critical or {},
               plan_fingerprint=None, plan_sha256=None, backends_used={"experts": "pytorch"}, lora=lora,
               family="language", model_config=cfg.to_dict(), tokenizer_dir=tokenizer_dir,
               tokenizer_sha256=tokenizer_sha256)
    return save_checkpoint(out, 7, write_engine_state=engine, trainer_state=doc, rank=0, world_size=1)
