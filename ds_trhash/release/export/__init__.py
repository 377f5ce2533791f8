"""An export: the verified SafeTensors model directory a checkpoint becomes (``writer``), the
tensors it holds (``tensors``), the manifest every reader checks it by (``manifest``) and the
``ds-trhash export`` command (``command``). ``manifest`` imports no torch: sync, cleanup and the
watcher read exports without it."""
