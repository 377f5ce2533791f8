"""The report's per-expert load figures and key fact, drawn from expert_load.csv."""
import numpy as np
from matplotlib.image import imread

from ds_trhash.report.expert_plots import busiest, render_balance, render_load_maps
from ds_trhash.report.plots import DPI, HEIGHT_IN, WIDTH_IN
from ds_trhash.report.series import StageSeries, read_expert_load

HEADER = "step,from_step,layer,expert_0,expert_1,expert_2\n"


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
