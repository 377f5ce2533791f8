"""expert_load.csv read back for the report: complete steps only, on the shared step axis."""
import numpy as np
import pytest

from ds_trhash.report.series import even_split_multiple, read_expert_load

HEADER = "step,from_step,layer,expert_0,expert_1,expert_2\n"


def test_only_steps_with_every_layer_are_read(tmp_path):
    path = tmp_path / "expert_load.csv"
    path.write_text(HEADER + "2,0,0,4,4,4\n2,0,1,6,3,3\n4,2,0,2,2,8\n4,2,1,4,4,4\n6,4,0,1,1,10\n6,4,1,4")
    load = read_expert_load(path, offset=100)  # step 6: layer 1 torn by a live writer, left out
    assert load.steps == [102, 104] and load.from_steps == [100, 102]
    assert load.counts.shape == (2, 2, 3) and load.counts[1, 0].tolist() == [2, 2, 8]
    assert load.total.tolist() == [[6, 6, 12], [10, 7, 7]]
    assert even_split_multiple(load.counts)[0, 1].tolist() == pytest.approx([1.5, 0.75, 0.75])  # 6 of 12 routes
    assert even_split_multiple(np.zeros((2, 3))).tolist() == [[0.0] * 3] * 2  # a layer with no routes yet
    assert read_expert_load(tmp_path / "absent.csv", offset=0) is None
    (tmp_path / "header_only.csv").write_text(HEADER)
    assert read_expert_load(tmp_path / "header_only.csv", offset=0) is None
