"""open_stage_data: the one call training makes for a stage's data, here on the embedded demo
corpus (what a plain `deepspeed launch/train.py --config ds_configs/tiny/pretrain.yaml` reads),
without the training package."""
import dataclasses

import pytest

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.config_fields import ConfigError
from ds_trhash.data.config import DataSection
from ds_trhash.data.stage import PretrainLoader, SFTLoader, StageRequest, embedded_root, open_stage_data
from tests.fail_closed import tree_digest


@pytest.fixture(scope="module")
def request_(tmp_path_factory):
    out = tmp_path_factory.mktemp("opening") / "run"
    return StageRequest(data=DataSection(seq_len=128), stage="pretraining", origin="test.yaml", output_dir=str(out),
                        seed=3, layout=BatchLayout(4, 2, rank=0, world_size=1), vocab_size=4096,
                        model="preset tiny", preset="tiny", max_steps=5)


def test_the_embedded_corpus_comes_through_the_one_call(request_):
    data = open_stage_data(request_)
    assert isinstance(data.loader, PretrainLoader) and data.loader.stream is None  # not reading before open
    assert data.total_steps == 5 and data.planned_steps > 5 and request_.tokens_per_step == 4 * 2 * 128
    assert data.plan is not None and embedded_root(request_.output_dir).is_dir()
    assert data.loader.recipe.layout == request_.layout and data.loader.recipe.end == 5
    sft = open_stage_data(dataclasses.replace(request_, stage="supervised-finetuning", max_steps=None, epochs=2,
                                              data=DataSection(kind="sft", seq_len=128), heldout=True))
    assert isinstance(sft.loader, SFTLoader) and sft.eval_batches is not None
    assert sft.total_steps == 2 * sft.loader.steps_per_epoch and sft.describe.startswith("SFT set ")


def test_refusals_name_the_config_key_and_write_nothing(request_, tmp_path):
    before = tree_digest(embedded_root(request_.output_dir))
    with pytest.raises(ConfigError, match=r"test.yaml: data.plan: required for preset 200m \(the embedded demo"):
        open_stage_data(dataclasses.replace(request_, preset="200m", model="preset 200m",
                                            output_dir=str(tmp_path / "run")))
    with pytest.raises(ConfigError, match=r"test.yaml: data.plan: the plan .* records vocab_size 4096, more than the "
                                          r"model's 100 \(preset tiny\): token ids beyond it have no embedding"):
        open_stage_data(dataclasses.replace(request_, vocab_size=100))
    assert tree_digest(embedded_root(request_.output_dir)) == before and not (tmp_path / "embedded").exists()
