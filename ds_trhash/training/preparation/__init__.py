"""Everything a launch decides before the model exists, and the checks it makes on the way.

* ``checks``     - output directory, resume source, init checkpoint, SFT set: the refusals a
  launch makes before it writes anything;
* ``stage_data`` - the stage's data (replay plan + shards, or the packed SFT set), checked;
* ``init_weights`` - the ``--init-checkpoint`` weights: verified, read once, fitted to the model;
* ``resources``  - devices, precision, memory, disk and packages against the stage;
* ``footprint``  - parameters, memory per rank and bytes per checkpoint, from the config alone.

The trainer and ``ds-trhash preflight`` both use these modules, so a verdict of preflight is
the trainer's own.
"""
