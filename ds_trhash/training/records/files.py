"""The names of the files a run's records are written under, for their writers and their readers:
``ds-trhash report`` reads them without importing the writers (``expert_load`` needs torch)."""

METRICS_FILE = "metrics.csv"
EXPERT_LOAD_FILE = "expert_load.csv"
