"""The demo's summary helpers (the demo itself is `make demo`: the three stages are covered by
tests/training/test_sft_stage.py through the same launches)."""

from ds_trhash.demo import column, deepspeed_command, loss_range


def test_summary_reads_losses_and_eval_columns(tmp_path):
    csv = tmp_path / "metrics.csv"
    csv.write_text("step,train_loss,eval_loss\n0,,6.5\n1,8.3,\n2,7.1,\n2,,6.1\n")
    assert loss_range(csv) == (8.3, 7.1, 2)
    assert column(csv, "eval_loss") == [6.5, 6.1]


def test_cpu_launch_form_uses_the_deepspeed_launcher():
    cmd = deepspeed_command("ds_configs/tiny/pretrain.yaml", 2, ["--output-dir", "x"])
    assert cmd[0].endswith("deepspeed") and cmd[1:3] == ["--num_gpus", "2"] and "--master_port" in cmd
    assert cmd[-4:] == ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", "x"]
