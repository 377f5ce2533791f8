"""What a checkpoint records besides tensors: the trainer state (the machine: test_hardware.py)."""
def test_the_launch_record_is_a_complete_trainer_state():
    from ds_trhash.checkpoints.state import LaunchRecord, TrainerState

    record = LaunchRecord(
        stage="pretraining", family="language", world_size=2, training_critical={"seed": 1}, plan_fingerprint="f",
        plan_sha256="s", plan_doc=None, init_checkpoint=None, lora=False, model_config={}, tokenizer_dir=None,
        tokenizer_sha256=None, tokenizer_assumed=False, sft_dir=None, sft_manifest_sha256=None, source_stage=None, hardware="2 process(es)",
        pack_of={5: 1, 10: 2})
    doc = record.trainer_state(step=5, epoch=0, total_steps=10, data_cursor=80, tokens_seen=1, supervised_seen=1,
                               backends_used={}, reason="token pack 1", peak_memory={}, extra={"eval": {"eval_loss": 2.0}})
    state = TrainerState.from_dict(doc)  # what every save and resume checks
    assert (state.step, state.world_size, state.pack_index, doc["packs"]) == (5, 2, 1, 2)
    assert doc["eval"] == {"eval_loss": 2.0} and record.trainer_state(
        step=6, epoch=0, total_steps=10, data_cursor=96, tokens_seen=1, supervised_seen=1, backends_used={},
        reason="final", peak_memory={})["pack_index"] is None
