"""The stage guard's tokenizer rule: the next stage's data is tokenized like its source checkpoint."""
import pytest

from ds_trhash.checkpoints.stages import StageError
from ds_trhash.data.stage import StageData
from ds_trhash.training.preparation.stage_guard import check_tokenizer_identity
from tests.training.callbacks import fakes


def _data(tok):
    return StageData(loader=fakes.Loader(), total_steps=1, tokenizer_sha256=tok)


def test_next_stage_data_must_use_the_checkpoints_tokenizer():
    check_tokenizer_identity({"tokenizer_sha256": "a" * 64}, _data("a" * 64), "ckpt")
    check_tokenizer_identity({}, _data("a" * 64), "ckpt")  # an export that records none
    with pytest.raises(StageError, match="rebuild the data with the checkpoint's tokenizer"):
        check_tokenizer_identity({"tokenizer_sha256": "a" * 64}, _data("b" * 64), "ckpt")
