"""DeepSpeed entry point: `deepspeed launch/train.py --config ds_configs/tiny/pretrain.yaml`.

The deepspeed launcher starts one copy per process and passes --local_rank; everything else
lives in the package (`ds_trhash.run` composes training with evaluation) so that this file
stays a thin, stable entry point.
"""

import sys

# First of all, before torch and DeepSpeed are imported (seconds): from here on SIGTERM/SIGINT
# only record a stop request, so a rank that another rank's early exit gets terminated by
# launch.py still prints its own message (ds_trhash/training/signals.py). A signal the SLURM job
# passed on before then is in the file it names (DS_TRHASH_PENDING_SIGNALS), adopted once installed.
from ds_trhash.training.signals import StopRequests

REQUESTS = StopRequests().install().adopt_pending()  # the launch's one recorder, handed to the entry point

from ds_trhash.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(requests=REQUESTS))
