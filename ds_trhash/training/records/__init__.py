"""The files a run leaves beside its checkpoints, one writer per file.

* ``files``       - the names of the files below (their readers need no writer);
* ``csv_log``     - append-only CSV with a fixed header, resume-safe;
* ``metrics_csv`` - ``metrics.csv`` (rank 0);
* ``expert_load`` - ``expert_load.csv``: route counts per expert and layer, summed over ranks;
* ``monitor``     - DeepSpeed's monitors (TensorBoard, CSV, W&B), peak memory, MFU.
"""
