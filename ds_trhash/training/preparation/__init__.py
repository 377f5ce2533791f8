"""Everything a launch decides before the model exists, and the checks it makes on the way.

* ``checks``     - output directory, resume source, init checkpoint, SFT set: the refusals a
  launch makes before it writes anything;
* ``request``    - ``LaunchRequest``: the command line and environment, resolved by the entry point;
* ``plan``       - ``plan_launch``: every check in order, the stage's data opened through the data
  package's one call (``data_request`` -> ``ds_trhash.data.stage.open_stage_data``);
* ``init_weights`` - the ``--init-checkpoint`` weights: verified, read once, fitted to the model;
* ``resources``  - devices, precision, memory, disk and packages against the stage;
* ``footprint``  - parameters, memory per rank and bytes per checkpoint, from the config alone.

The trainer and ``ds-trhash preflight`` both use these modules, so a verdict of preflight is
the trainer's own.
"""
