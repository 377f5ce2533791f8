"""One tiny model exported once for the transformers-export, chat-template and generate tests;
the stand-in Hub for the sync, watch and cleanup tests."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.model.routing import expert_pairs, pair_codes
from tests.data.sft_fixtures import VOCAB_SIZE
from tests.release.hub_server import HubServer

TOKEN = "hf_FAKEtokenVALUE0123456789abcd"


@dataclass
class TinyExport:
    config: TRHashConfig
    model: TRHashForCausalLM  # the trainer's model holding exactly the exported weights
    state: dict
    out: Path  # the export directory
    tokenizer_dir: Path


def shifted_routes(state: dict, config: TRHashConfig, layer: int) -> dict:
    """Layer `layer` routed to other experts than its config builds (still a valid table), so a
    loader that rebuilt routes from the config instead of reading them would be caught."""
    prefix = f"layers.{layer}.mlp.engine."
    table = (state[prefix + "route_table"] + 1) % config.num_experts
    codes = pair_codes(table, expert_pairs(config.num_experts))
    return {**state, prefix + "route_table": table, prefix + "fused_route_codes": codes}


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory, tokenizer_dir) -> TinyExport:
    from ds_trhash.release.export.writer import export_safetensors

    torch.manual_seed(0)
    # init_std 0.1: a tiny random model at the default 0.02 repeats one token forever, which
    # would make "cached equals recomputed" true for the wrong reason.
    config = TRHashConfig.from_preset("tiny", vocab_size=VOCAB_SIZE, num_layers=2, init_std=0.1, max_seq_len=128)
    model = TRHashForCausalLM(config)
    state = shifted_routes({k: v.detach().clone() for k, v in model.state_dict().items()}, config, layer=1)
    assert model.load_checkpoint_state(state)  # routes now differ from the config's, on purpose
    out = tmp_path_factory.mktemp("hf") / "export"
    export_safetensors(state, out, model_config=config.to_dict(), tokenizer_dir=tokenizer_dir,
                       stage="supervised-finetuning")
    return TinyExport(config, model.eval(), state, out, tokenizer_dir)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and a shared CI machine is not slowed by spinning)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def stand_in_hub(monkeypatch, deadline_s: float = 120.0) -> Iterator[HubServer]:
    """The stand-in Hub, with HF_ENDPOINT / HF_TOKEN / HF_HUB_DISABLE_XET set as a user would.
    huggingface_hub reads the endpoint and the Xet switch once, at import, and this process
    imported it already, so its constants are pointed at the server too."""
    with HubServer(TOKEN, deadline_s=deadline_s) as srv:
        for key, value in {"HF_ENDPOINT": srv.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1"}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(constants, "ENDPOINT", srv.url)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        yield srv


@pytest.fixture
def server(monkeypatch):
    with stand_in_hub(monkeypatch) as srv:
        yield srv
