"""The report's per-expert load: expert_load.csv read back (complete steps only, on the shared
step axis), the two figures drawn from it, and the key fact."""
import numpy as np
import pytest
from matplotlib.image import imread

from ds_trhash.report.expert_plots import busiest, render_balance, render_load_maps
from ds_trhash.report.plots import DPI, HEIGHT_IN, WIDTH_IN
from ds_trhash.report.series import StageSeries, read_expert_load

HEADER = "step,from_step,layer,expert_0,expert_1,expert_2\n"


def test_only_steps_with_every_layer_are_read(tmp_path):
    path = tmp_path / "expert_load.csv"
    path.write_text(HEADER + "2,0,0,4,4,4\n2,0,1,6,3,3\n4,2,0,2,2,8\n4,2,1,4,4,4\n6,4,0,1,1,10\n6,4,1,4")
    load = read_expert_load(path, offset=100)  # step 6: layer 1 torn by a live writer, left out
    assert load.steps == [102, 104] and load.from_steps == [100, 102]
    assert load.counts.shape == (2, 2, 3) and load.counts[1, 0].tolist() == [2, 2, 8]
    assert load.total.tolist() == [[6, 6, 12], [10, 7, 7]]
    assert load.relative()[0, 1].tolist() == pytest.approx([1.5, 0.75, 0.75])  # 6 of 12 routes, 3 experts
    assert read_expert_load(tmp_path / "absent.csv", offset=0) is None
    (tmp_path / "header_only.csv").write_text(HEADER)
    assert read_expert_load(tmp_path / "header_only.csv", offset=0) is None


def _stage(tmp_path, name, offset, counts):
    path = tmp_path / f"{name}.csv"
    lines = [f"{s},{s - 1},{layer},{','.join(map(str, c))}" for s, step in enumerate(counts, 1)
             for layer, c in enumerate(step)]
    path.write_text(HEADER + "\n".join(lines) + "\n")
    series = StageSeries(run_dir=tmp_path, stage=name, offset=offset, last_step=len(counts))
    series.expert_load = read_expert_load(path, offset)
    return series


def test_figures_have_the_report_size_and_are_not_blank(tmp_path):
    rng = np.random.default_rng(0)
    stages = [_stage(tmp_path, "pretraining", 0, rng.integers(50, 150, size=(6, 16, 3))),
              StageSeries(run_dir=tmp_path, stage="refinement", offset=6, last_step=3),  # recorded none
              _stage(tmp_path, "supervised-finetuning", 9, rng.integers(50, 150, size=(4, 16, 3)))]
    for render in (render_load_maps, render_balance):
        pixels = imread(render(stages, tmp_path))
        assert pixels.shape[:2] == (int(HEIGHT_IN * DPI), int(WIDTH_IN * DPI)), render.__name__
        assert pixels[..., :3].std() > 0.05, f"{render.__name__} looks blank"
    assert busiest(stages[1]) == "not recorded"


def test_the_busiest_expert_is_named_with_its_multiple_of_an_even_split(tmp_path):
    counts = np.full((2, 3, 3), 10)
    counts[:, 2, 1] = 40  # layer 2, expert 1: 40 of 60 routes -> 2.0 x an even split
    assert busiest(_stage(tmp_path, "pretraining", 0, counts)) == "layer 2 expert 1: 2.000 x an even split"
