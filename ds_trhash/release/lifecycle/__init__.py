"""The end of a completed stage: ``final/`` and the completion record (``final``), the deletion of
numbered checkpoints once nothing depends on them (``cleanup``), and what rank 0 does when the
stage reached its last step (``finish``)."""
