"""How `make test` spreads the suite over its xdist workers (``--dist loadfile``, with the
scheduler of tests/conftest.py).

A work unit is a group of whole test files: one file by default (its module fixtures run once),
or several files that read one session fixture (so that it is made on one worker, not on each).
xdist starts the units with the most tests first; that left the long launch files with one or
two tests for the end, where the last of them ran alone on a core for a minute and more
(measured: the cores 66-85 % busy over the last 90 s of the suite). The units in ``FIRST`` start
before every other, longest first, so that the suite ends on the many short files, which fill
both cores until the last.
"""
from __future__ import annotations

# files that read the same session fixture: one unit
SHARED = {
    "tests/prelaunch/test_preflight.py": "prelaunch",  # prelaunch_runs (tests/prelaunch/runs.py)
    "tests/prelaunch/test_smoke.py": "prelaunch",
    "tests/ops/test_jobs.py": "ops-supervised",  # supervised (tests/ops/conftest.py)
    "tests/ops/test_report.py": "ops-supervised",
}


# the longest units, longest first (wall seconds of each under the suite's load, 2-core machine);
# the long launch files with one or two tests would otherwise come last
FIRST = (
    "tests/training/test_resume_equivalence.py",  # ~250 s: kills and resumes on 1 and 2 processes (and the
    # 1- and 2-process references that other files share)
    "tests/training/liveness/test_lost_rank_launch.py",  # ~150 s: one two-node run frozen (a 30 s silence),
    # resumed and stuck (a 15 s stuck limit), resumed to the end, one launch after another
    # ~390 s at a load average of 8 (with the ZeRO-1 and ZeRO-2 reference launches it shares):
    # 12-step 2-process launches, an out-of-memory retry, a kill and its resume, a ZeRO-2 exit 77
    # and its resume
    "tests/training/memory/test_out_of_memory_launch.py",
    "tests/training/test_sft_stage.py",  # ~270 s: refinement, SFT, LoRA, their resumes
    "tests/training/test_hub_outage_launch.py",  # ~210 s (416 s measured beside five other sessions): outages,
    # a failed read on one node and on two nodes of two ranks, Ctrl-C before the first step and mid-run
    # while downloads stall on two nodes
    "tests/training/test_real_network_faults.py",  # ~200 s: one run on two hosts of their own, each node
    # killed and the cable cut in turn (every survivor gone with exit 76), each fault resumed by the next launch
    "tests/training/test_real_network.py",  # ~60 s: a master no host reaches (two hosts, network namespaces)
    "tests/training/test_compile_launch.py",  # ~140 s: inductor on CPU
    "tests/training/test_stop_signals.py",  # ~150 s: 4 signalled 2-process launches, a refused relaunch
    "tests/training/test_multinode.py",  # ~130 s: two launchers through a 45 s Hub outage, a resume on one
    "tests/training/test_expert_parallel_launch.py",  # ~110 s: ep_size 2 killed and resumed, resharded
    # 2 -> 1 and 1 -> 2 ranks, a custom shape exported
    "tests/prelaunch/test_slurm_launch.py",  # ~100 s: a SLURM job warned mid-run and before its ranks started,
    # requeued twice and finished; a failed one
    "tests/training/test_disk_failures.py",  # ~90 s
    "tests/release/lifecycle/test_finish.py",  # ~40 s: a watched run through SIGHUP to its final export
    "tests/training/test_stream_launch.py",  # ~75 s: a streamed 2-process run killed mid-download
    "tests/training/test_release_layout_launch.py",  # ~40 s
    "tests/training/test_run_lock_launches.py",  # ~40 s: a waiting launch that resumes, a refused one
    "tests/test_readme.py",  # ~35 s: the README's command blocks through bash, as written
    # ~80 s: micro_batch auto on two ranks with different memory caps, its resume and a refused one
    "tests/training/memory/test_auto_launch.py",
    # ~50 s at a load average of 12 (19 s of CPU): the saved-tensor check of the activation term,
    # Triton and Liger in the interpreter
    "tests/training/preparation/test_activation_term.py",
)


def unit_of(path: str) -> str:
    """The work unit of a test file (its path relative to the repository root)."""
    return SHARED.get(path, path)
