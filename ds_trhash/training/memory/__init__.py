"""Device memory and the micro-batch: an out-of-memory step retried at a smaller micro-batch by
every rank together, or every rank stopped (exit 77) where a collective lies in between, and the
size in force recorded for the resume (docs/operations.md, "Out of device memory").

The data's cut of a step (which global rows each rank reads, ``batch_layout``) stays the one the
launch plan froze: a smaller micro-batch only cuts each rank's rows of the step finer
(``sizes.recut``), so the step trains the same rows and its loss is the same sum.
"""
