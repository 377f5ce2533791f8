"""DeepSpeed entry point: `deepspeed launch/train.py --config ds_configs/tiny/pretrain.yaml`.

The deepspeed launcher starts one copy per process and passes --local_rank; everything else
lives in the package (`ds_trhash.run` composes training with evaluation) so that this file
stays a thin, stable entry point.
"""

import sys

from ds_trhash.run import main

if __name__ == "__main__":
    sys.exit(main())
