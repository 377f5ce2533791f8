"""The names of the files a run's records are written under, for their writers and their readers:
``ds-trhash report`` reads them without importing the writers (``expert_load`` needs torch)."""

METRICS_FILE = "metrics.csv"
EXPERT_LOAD_FILE = "expert_load.csv"
CONFIG_FILE = "config.json"  # the config as loaded, written by every launch
MONITORS_DIR = "monitors"  # DeepSpeed's monitors, unless their output_path says otherwise
# what the trainer itself writes at the top of the output directory (the callbacks name theirs:
# ``Callback.run_files``)
TRAINER_FILES = (CONFIG_FILE, MONITORS_DIR)
