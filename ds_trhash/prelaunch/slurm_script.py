"""The text of the sbatch script `ds-trhash ops slurm` writes: a batch part and a per-node part.

Why one `deepspeed --no_ssh` launcher per node, started by `srun`, rather than DeepSpeed's own
`--launcher slurm`: DeepSpeed's SLURM backend runs `srun -n <ranks> python train.py` from the
first node, so every rank is a task of srun and none is started by `deepspeed.launcher.launch`:
no RANK, LOCAL_RANK, WORLD_SIZE or MASTER_ADDR is set for it (it counts on MPI discovery), and the
launch.py behaviour the stop handling is built on (one rank's failure ends the node's others; its
exit status reaches the job) is gone. One launcher per node keeps a node's ranks exactly what a
single-node or `--no_ssh` launch starts, and srun still places one task per node.

The signals, in order (docs/operations.md, "SLURM"):
- `#SBATCH --signal=B:USR1@T`: SLURM warns the batch shell T seconds before the time limit. Its
  trap passes SIGUSR1 to srun, which passes it to the step (every process of it, on real SLURM).
- On each node the deepspeed runner and launch.py are started with SIGUSR1 ignored (inherited
  across exec), so the warning cannot kill them wherever SLURM delivers it; the node part also
  signals the ranks themselves (launch.py's children), which stop after an agreed checkpoint and
  exit EXIT_REQUEUE; launch.py and the runner pass that status on.
- A node whose launcher exited EXIT_REQUEUE (or EXIT_OUT_OF_MEMORY: a step out of device memory
  that the ranks could not retry in place, the smaller micro-batch recorded for the next attempt)
  marks it in the logs folder and exits 0 (srun runs
  with --kill-on-bad-exit, so a failing node ends the others at once; the requeue must not).
- The batch shell reads srun's status and the marks: a requeue mark requeues the job (`scontrol
  requeue`; the next attempt runs the same `--resume auto` launch), 0 ends the job, anything
  else ends it without a requeue, naming the nodes' logs.
- A node that reported EXIT_PEER_LOST (a rank was lost) requeues the job with the host that
  ``<output dir>/lost_peer.json`` blames added to the job's ExcNodeList (``prelaunch.lost_peer``
  checks the record), at most ``--max-lost-node-requeues`` times over the job's attempts.
- A signal that comes before the ranks could record it is not lost: both shells trap it from their
  first line; before srun the batch shell starts no training (SIGTERM ends the job, SIGUSR1
  requeues it); after, every signal passed on is also written to ``DS_TRHASH_PENDING_SIGNALS``,
  which each rank reads right after installing its handlers (``StopRequests.adopt_pending``).
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ds_trhash.checkpoints.run_source import COMPLETE_FILE
from ds_trhash.training.signals import EXIT_OUT_OF_MEMORY, EXIT_PEER_LOST, EXIT_REQUEUE

# The job's master port: MASTER_PORT_BASE + job id % MASTER_PORT_SPAN (a requeued job keeps its id,
# so every attempt uses the same port; two jobs sharing a node use different ones unless their ids
# are MASTER_PORT_SPAN apart).
MASTER_PORT_BASE = 15000
MASTER_PORT_SPAN = 15000
# requeues after a lost rank (exit 76), each without the host its record blames, over a job's attempts
MAX_LOST_NODE_REQUEUES = 3


def master_port(job_id: int) -> int:
    """The port the script derives from SLURM_JOB_ID (the same arithmetic, for tests and docs)."""
    return MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN


@dataclass
class SlurmJob:
    """Everything the script needs, checked (``ds_trhash.prelaunch.slurm.check_job``)."""

    script: Path
    workdir: Path  # the repository root: launch/train.py and relative config paths
    deepspeed: Path
    run_dir: Path
    nodes: int
    gpus_per_node: int
    launch_args: list[str]  # after launch/train.py, --resume auto included
    job_name: str
    warning_seconds: int
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    cpus_per_node: int | None = None  # None: whole nodes (--exclusive)
    sbatch_options: list[str] = field(default_factory=list)
    summary: str = ""
    max_lost_node_requeues: int = MAX_LOST_NODE_REQUEUES
    python: Path = field(default_factory=lambda: Path(sys.executable))  # reads a lost-peer record

    @property
    def logs(self) -> Path:
        return self.run_dir / "slurm" / "logs"


def _sbatch_lines(job: SlurmJob) -> list[str]:
    # one task per node, so the task's CPUs are the node's: without them SLURM gives it one CPU
    cpus = f"--cpus-per-task={job.cpus_per_node}" if job.cpus_per_node else "--exclusive"
    lines = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
             f"--gpus-per-node={job.gpus_per_node}", cpus]
    lines += [f"--{name}={value}" for name, value in
              (("partition", job.partition), ("account", job.account), ("time", job.time)) if value]
    lines += [f"--signal=B:USR1@{job.warning_seconds}", "--requeue", "--open-mode=append",
              f"--output={job.run_dir / 'slurm' / 'job-%j.out'}", *job.sbatch_options]
    return ["#SBATCH " + line for line in lines]


# The part each node runs (srun starts it once per node): its launcher, its log, the signals.
NODE_PART = r'''
set -u
# the signals first: one that comes before the ranks exist is written where each rank reads it when
# it starts (DS_TRHASH_PENDING_SIGNALS, read right after its handlers are installed), then passed to
# the ranks that exist (launch.py's children, the runner's grandchildren)
LAUNCHER=
signal_ranks() {
    local launch_py ranks
    echo "$1" >>"$DS_TRHASH_PENDING_SIGNALS"
    [ -n "$LAUNCHER" ] && launch_py=$(pgrep -d, -P "$LAUNCHER") && ranks=$(pgrep -d, -P "$launch_py") && kill "-$1" ${ranks//,/ } 2>/dev/null
    return 0
}
trap 'signal_ranks USR1' USR1
trap 'signal_ranks TERM' TERM INT
cd "$DS_TRHASH_WORKDIR" || exit 1
LOG="$DS_TRHASH_LOG_DIR/node-$SLURM_NODEID.log"
echo "ds-trhash: node $SLURM_NODEID ($(hostname)): launcher starting; log $LOG"
# SIGUSR1 ignored in the runner and launch.py (inherited across exec): the time-limit warning,
# wherever SLURM delivers it, reaches only the ranks, which install their own handler.
( trap '' USR1; exec "$DS_TRHASH_DEEPSPEED" --hostfile "$DS_TRHASH_HOSTFILE" --no_ssh \
    --node_rank "$SLURM_NODEID" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    @@LAUNCH@@ ) >>"$LOG" 2>&1 &
LAUNCHER=$!
while :; do
    wait "$LAUNCHER"; status=$?
    { [ "$status" -le 128 ] || ! kill -0 "$LAUNCHER" 2>/dev/null; } && break  # else a trap interrupted the wait
done
echo "ds-trhash: node $SLURM_NODEID: launcher exited with status $status" | tee -a "$LOG"
echo "$status" >"$DS_TRHASH_LOG_DIR/node-$SLURM_NODEID.status"
# a stop for a requeue leaves a mark and exits 0: a non-zero task would make srun (--kill-on-bad-exit)
# terminate the other nodes while they finish their own exit
# (an out-of-memory stop too: the next attempt resumes at the smaller micro-batch the run recorded)
if [ "$status" -eq @@EXIT_REQUEUE@@ ] || [ "$status" -eq @@EXIT_OUT_OF_MEMORY@@ ]; then
    : >"$DS_TRHASH_LOG_DIR/node-$SLURM_NODEID.requeue"; status=0
fi
exit "$status"
'''

BATCH_PART = r'''
set -u
# the stop signals are recorded from the first line: one that comes before srun has started the ranks
# is not lost (before srun: no training is started; after: the ranks read it when they start)
SRUN= PENDING=
forward() {  # $1: the signal, $2: what it means
    echo "ds-trhash: $(date -u +%FT%TZ) $1: $2"
    PENDING="$PENDING $1"
    [ -n "${DS_TRHASH_PENDING_SIGNALS:-}" ] && echo "$1" >>"$DS_TRHASH_PENDING_SIGNALS"
    [ -n "$SRUN" ] && kill "-$1" "$SRUN" 2>/dev/null
    return 0
}
trap 'forward USR1 "the time limit is near; every rank stops after a checkpoint, then the job is requeued"' USR1
trap 'forward TERM "stopping; every rank stops after a checkpoint if time allows"' TERM
: "${SLURM_JOB_ID:?is not set: submit this script with sbatch}"
SCRIPT=@@SCRIPT@@
export DS_TRHASH_WORKDIR=@@WORKDIR@@
export DS_TRHASH_DEEPSPEED=@@DEEPSPEED@@
PYTHON=@@PYTHON@@
RUN_DIR=@@RUN_DIR@@
GPUS_PER_NODE=@@GPUS@@
EXIT_REQUEUE=@@EXIT_REQUEUE@@  # the ranks' status after a stop on the warning: requeue me
EXIT_PEER_LOST=@@EXIT_PEER_LOST@@  # a rank was lost: requeue without its host
MAX_LOST_NODE_REQUEUES=@@MAX_LOST@@
LOG_ROOT=@@LOGS@@
cd "$DS_TRHASH_WORKDIR" || exit 1

ATTEMPT=${SLURM_RESTART_COUNT:-0}
export DS_TRHASH_LOG_DIR="$LOG_ROOT/job-$SLURM_JOB_ID-attempt-$ATTEMPT"
mkdir -p "$DS_TRHASH_LOG_DIR" || exit 1
# every signal passed on, one name a line: a rank reads it when it starts (a signal sent before then is lost)
export DS_TRHASH_PENDING_SIGNALS="$DS_TRHASH_LOG_DIR/signals"
for sig in $PENDING; do echo "$sig"; done >>"$DS_TRHASH_PENDING_SIGNALS"
HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST") || { echo "ds-trhash: error: scontrol show hostnames failed"; exit 1; }
export DS_TRHASH_HOSTFILE="$DS_TRHASH_LOG_DIR/hostfile"
for host in $HOSTS; do echo "$host slots=$GPUS_PER_NODE"; done >"$DS_TRHASH_HOSTFILE"
NODES=$(wc -l <"$DS_TRHASH_HOSTFILE")
export MASTER_ADDR=$(head -n 1 "$DS_TRHASH_HOSTFILE" | cut -d' ' -f1)
export MASTER_PORT=$((@@PORT_BASE@@ + SLURM_JOB_ID % @@PORT_SPAN@@))
echo "ds-trhash: job $SLURM_JOB_ID attempt $ATTEMPT: $NODES node(s) x $GPUS_PER_NODE, master $MASTER_ADDR:$MASTER_PORT;" \
     "logs $DS_TRHASH_LOG_DIR/node-*.log"

requeue() {
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    echo "ds-trhash: error: scontrol requeue $SLURM_JOB_ID failed; continue the run with: sbatch $SCRIPT"
    exit 1
}

# a rank was lost (exit 76): requeue with the host its record blames added to the job's excluded
# nodes, up to MAX_LOST_NODE_REQUEUES times over the job's attempts
requeue_without_lost_host() {
    local history="$LOG_ROOT/job-$SLURM_JOB_ID.lost-nodes" record="$RUN_DIR/lost_peer.json" found host= what= excluded
    local count=0
    [ -e "$history" ] && count=$(grep -c '' "$history")
    if [ -e "$record" ] && [ "$record" -nt "$DS_TRHASH_HOSTFILE" ]; then  # written by this attempt
        if found=$("$PYTHON" -m ds_trhash.prelaunch.lost_peer "$record" $HOSTS 2>&1); then
            IFS=$'\t' read -r host what <<<"$found"
        else
            echo "ds-trhash: warning: the lost-peer record cannot be used: ${found//$'\n'/ }; no host is excluded"
        fi
    else
        echo "ds-trhash: warning: this attempt wrote no lost-peer record ($record); no host is excluded"
    fi
    echo "ds-trhash: a rank was lost (exit $EXIT_PEER_LOST): ${what:-which one is not recorded}${host:+ on host $host}"
    if [ "$count" -ge "$MAX_LOST_NODE_REQUEUES" ]; then
        echo "ds-trhash: error: not requeued: job $SLURM_JOB_ID was requeued $count time(s) after a lost rank already" \
             "(--max-lost-node-requeues $MAX_LOST_NODE_REQUEUES; $history lists them); find the cause in" \
             "$DS_TRHASH_LOG_DIR/node-*.log, then continue the run with: sbatch $SCRIPT"
        exit "$EXIT_PEER_LOST"
    fi
    if [ -n "$host" ]; then
        excluded=$(scontrol show job "$SLURM_JOB_ID" | grep -o 'ExcNodeList=[^ ]*'); excluded=${excluded#ExcNodeList=}
        [ "$excluded" = "(null)" ] && excluded=
        case ",$excluded," in *",$host,"*) ;; *) excluded=${excluded:+$excluded,}$host ;; esac
        scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$excluded" \
            || echo "ds-trhash: warning: scontrol update ExcNodeList=$excluded failed; the next attempt may get $host again"
    fi
    echo "attempt $ATTEMPT: ${host:-(no host)}: ${what:-no record}" >>"$history"
    echo "ds-trhash: requeueing job $SLURM_JOB_ID${host:+ without $host (excluded: $excluded)}" \
         "($((count + 1)) of $MAX_LOST_NODE_REQUEUES after a lost rank); its next attempt continues with --resume auto"
    requeue
}

# a signal before srun starts the ranks: no training is started
case " $PENDING " in
*" TERM "*) echo "ds-trhash: stopped before training started (SIGTERM); nothing was trained in this attempt;" \
                 "continue the run with: sbatch $SCRIPT"
            exit 0 ;;
*" USR1 "*) echo "ds-trhash: the time-limit warning came before training started: requeueing job $SLURM_JOB_ID" \
                 "without starting it; its next attempt continues with --resume auto"
            requeue ;;
esac

# what srun runs on every node (one task per node)
read -r -d '' NODE_PART <<'NODE'
@@NODE_PART@@
NODE

srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$NODE_PART" &
SRUN=$!
while :; do
    wait "$SRUN"; status=$?
    { [ "$status" -le 128 ] || ! kill -0 "$SRUN" 2>/dev/null; } && break  # else a trap interrupted the wait
done
trap '' USR1  # a late warning changes nothing now (its default action would end this shell)
trap - TERM

if [ "$status" -eq 0 ] && compgen -G "$DS_TRHASH_LOG_DIR/node-*.requeue" >/dev/null; then
    echo "ds-trhash: every rank stopped for a requeue (exit $EXIT_REQUEUE after a complete checkpoint, or" \
         "@@EXIT_OUT_OF_MEMORY@@ out of device memory with a smaller micro-batch recorded): requeueing job" \
         "$SLURM_JOB_ID; its next attempt continues with --resume auto"
    requeue
elif [ "$status" -eq 0 ] && [ -e "$RUN_DIR/@@COMPLETE@@" ]; then
    echo "ds-trhash: the stage is complete: $RUN_DIR/@@COMPLETE@@"
    exit 0
elif [ "$status" -eq 0 ]; then
    echo "ds-trhash: training stopped before the end of the stage (a stop signal) after a complete checkpoint;" \
         "not requeued; continue it with: sbatch $SCRIPT"
    exit 0
fi
# a node whose ranks lost another rank: whatever the lost rank's own node reported (a killed launcher, srun's 143)
cat "$DS_TRHASH_LOG_DIR"/node-*.status 2>/dev/null | grep -qx "$EXIT_PEER_LOST" && requeue_without_lost_host
# the cause is the lowest failing status a node reported (srun ends the other nodes after it: 143)
nodes=$(cd "$DS_TRHASH_LOG_DIR" && for f in node-*.status; do [ -e "$f" ] && printf '%s exit %s, ' "${f%.status}" "$(cat "$f")"; done)
first=$(cat "$DS_TRHASH_LOG_DIR"/node-*.status 2>/dev/null | grep -vx 0 | sort -n | head -n 1)
[ -n "$first" ] && status=$first
echo "ds-trhash: error: training failed with exit status $status (job $SLURM_JOB_ID, attempt $ATTEMPT: ${nodes%, });" \
     "not requeued; the logs: $DS_TRHASH_LOG_DIR/node-*.log"
grep -h "error" "$DS_TRHASH_LOG_DIR"/node-*.log | head -n 5
exit "$status"
'''


def render(job: SlurmJob) -> str:
    """The script's text: header, #SBATCH lines, the batch part with the node part inside."""
    q = shlex.quote
    node = (NODE_PART.strip("\n").replace("@@LAUNCH@@", shlex.join(["launch/train.py", *job.launch_args]))
            .replace("@@EXIT_REQUEUE@@", str(EXIT_REQUEUE)).replace("@@EXIT_OUT_OF_MEMORY@@", str(EXIT_OUT_OF_MEMORY)))
    values = {
        "SCRIPT": q(str(job.script)), "WORKDIR": q(str(job.workdir)), "DEEPSPEED": q(str(job.deepspeed)),
        "PYTHON": q(str(job.python)), "RUN_DIR": q(str(job.run_dir)), "GPUS": str(job.gpus_per_node),
        "EXIT_REQUEUE": str(EXIT_REQUEUE), "EXIT_PEER_LOST": str(EXIT_PEER_LOST),
        "MAX_LOST": str(job.max_lost_node_requeues), "LOGS": q(str(job.logs)), "EXIT_OUT_OF_MEMORY": str(EXIT_OUT_OF_MEMORY),
        "PORT_BASE": str(MASTER_PORT_BASE), "PORT_SPAN": str(MASTER_PORT_SPAN), "COMPLETE": COMPLETE_FILE,
        "NODE_PART": node,
    }
    body = BATCH_PART
    for key, value in values.items():
        body = body.replace(f"@@{key}@@", value)
    header = ["#!/bin/bash",
              "# Written by `ds-trhash ops slurm`; submit it with: sbatch " + q(str(job.script)),
              *(f"# {line}" for line in job.summary.splitlines()),
              *_sbatch_lines(job)]
    return "\n".join(header) + "\n" + body
