"""The Protocol the package types DeepSpeed's engine with names only what the engine has: every
attribute and method of ``DeepSpeedEngine`` is there on an engine DeepSpeed builds here, so a
DeepSpeed upgrade that drops or renames one fails this test, not a launch."""
import inspect

import torch

from ds_trhash.engine_api import DeepSpeedEngine
from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.training import config as tcfg
from ds_trhash.training.engine import build_engine
from tests.training.test_engine import one_rank_group  # noqa: F401  (a fixture)


def _members() -> list[str]:
    methods = [name for name, value in vars(DeepSpeedEngine).items()
               if inspect.isfunction(value) and (not name.startswith("_") or name == "__call__")]
    return sorted({*DeepSpeedEngine.__annotations__, *methods})


def test_an_engine_deepspeed_builds_has_every_member_the_protocol_names(one_rank_group):  # noqa: F811
    cfg = tcfg.load_config("ds_configs/tiny/pretrain.yaml", ["batch.micro_batch=2"])
    torch.manual_seed(cfg.seed)
    model = TRHashForCausalLM(TRHashConfig.from_preset(cfg.model.preset))
    eng = build_engine(model, cfg, tcfg.to_deepspeed_dict(cfg, 1), 4)
    try:
        members = _members()
        assert {"module", "optimizer", "global_steps", "save_checkpoint", "load_checkpoint", "__call__"} <= set(members)
        missing = [name for name in members if not hasattr(eng.engine, name)]
        assert not missing, f"DeepSpeed's engine has no {missing}: engine_api.DeepSpeedEngine names them"
        assert all(callable(getattr(eng.engine, name)) for name in members if name in vars(DeepSpeedEngine))
    finally:
        eng.engine.destroy()
