"""What a run leaves for others: its export, its copy on the Hub, the end of a completed stage, its record.

Rooms, in the direction a finished run's files flow (an arrow is "may import"):
``hf`` (the transformers model code copied into every export) <- ``export`` (write, verify and
describe an export) <- ``lifecycle`` (``final/``, the completion record, cleanup after success) and
``record`` (the publishable run record) <- ``hub`` (sync to the Hub, the watcher beside a run).
``generate`` and ``commands`` sit on top. No room imports training.
"""
