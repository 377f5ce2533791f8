"""What liveness costs the training thread: step times with the liveness thread running and
without, and the training thread's own share (the beacon's attribute writes).

    python bench/bench_liveness.py --preset tiny --steps 60
    python bench/bench_liveness.py --preset 200m --seq-len 64 --steps 50

One process: the model's forward, backward and AdamW step on this machine's device, the beacon
written at every place the loop writes it (data, forward/backward, optimizer, nine hooks), while
a real ``Liveness`` of this rank (and one peer's, answering it) beats over UDP on 127.0.0.1 at
``--interval`` seconds. The steps alternate in blocks between "on" (both threads beating) and
"off" (none), so a drift of the machine's load hits both alike. Printed: the median step of each,
their difference, the beacon's cost per step measured alone (it is all the training thread does
for liveness), the liveness thread's CPU time per second, and each as a share of the median step.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_trhash.model import TRHashConfig, TRHashForCausalLM  # noqa: E402
from ds_trhash.training.liveness.channel import Channel, PeerInfo  # noqa: E402
from ds_trhash.training.liveness.monitor import Liveness  # noqa: E402
from ds_trhash.training.liveness.phases import (  # noqa: E402
    CHECKPOINT, DATA_WAIT, FORWARD_BACKWARD, HOOKS, MARK_DATA, MARK_FORWARD, MARK_OPTIMIZER, OPTIMIZER, STEP_END,
    Beacon, Limits)

HOOK_PHASES = (DATA_WAIT, STEP_END, STEP_END, STEP_END, STEP_END, CHECKPOINT, CHECKPOINT, STEP_END, STEP_END)


def pair(interval: float) -> tuple[Liveness, Liveness]:
    """This rank's liveness and one peer's, each knowing the other (no store: one process)."""
    limits = Limits(interval_s=interval, silent_s=30.0, stuck_s=300.0, by_phase={})
    a, b = Channel("127.0.0.1", "bench"), Channel("127.0.0.1", "bench")
    pa, pb = PeerInfo(0, 0, "a", "127.0.0.1", a.port), PeerInfo(1, 1, "b", "127.0.0.1", b.port)
    refuse = lambda verdict: (_ for _ in ()).throw(AssertionError(f"a verdict in the benchmark: {verdict}"))  # noqa: E731
    live, peer = Liveness(a, pa, [pb], limits, act=refuse), Liveness(b, pb, [pa], limits, act=refuse)
    peer.beacon = live.beacon  # the peer trains in step (the stuck rule sees it at the same place)
    return live, peer


def mark_places(beacon: Beacon, step: int) -> None:
    """The beacon writes of one step, as loop.py makes them."""
    beacon.at(step, MARK_DATA, DATA_WAIT)
    beacon.at(step, MARK_FORWARD, FORWARD_BACKWARD)
    beacon.mark, beacon.phase = MARK_OPTIMIZER, OPTIMIZER
    for i, phase in enumerate(HOOK_PHASES):
        beacon.at(step, HOOKS + i, phase)


def beacon_cost_s(repeats: int = 200_000) -> float:
    beacon = Beacon()
    t0 = time.perf_counter()
    for step in range(repeats):
        mark_places(beacon, step)
    return (time.perf_counter() - t0) / repeats


def model_step(args):
    torch.manual_seed(0)
    model = TRHashForCausalLM(TRHashConfig.from_preset(args.preset))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (args.micro_batch, args.seq_len))

    def step(beacon: Beacon, n: int) -> float:
        t0 = time.perf_counter()
        mark_places(beacon, n)
        loss = model(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return step


def measure(args) -> dict:
    step = model_step(args)
    on, off, live, peer = [], [], *pair(args.interval)
    for n in range(args.warmup):
        step(live.beacon, n)
    for block in range(2 * ((args.steps + args.block - 1) // args.block)):
        running = block % 2 == 0
        if running and live._thread is None:
            live.start(), peer.start()
        target = on if running else off
        for _ in range(args.block):
            target.append(step(live.beacon if running else Beacon(), len(on) + len(off)))
    for side in (live, peer):
        side.close(0)
    return {"on": on, "off": off, "beacon_s": beacon_cost_s(), "monitor_cpu_per_s": monitor_cpu(args.interval)}


def monitor_cpu(interval: float, seconds: float = 10.0) -> float:
    """CPU seconds per wall second of one liveness thread (and its peer's), measured over ``seconds``."""
    live, peer = pair(interval)
    t0 = time.process_time()
    wall = time.perf_counter()
    live.start(), peer.start()
    time.sleep(seconds)
    used = time.process_time() - t0
    for side in (live, peer):
        side.close(0)
    return used / (time.perf_counter() - wall) / 2  # two threads beat: one rank's share


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=["tiny", "200m"])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=60, help="steps of each kind (on, off): at least 50")
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    r = measure(args)
    on, off = statistics.median(r["on"]), statistics.median(r["off"])
    print(f"liveness at preset {args.preset}, micro_batch {args.micro_batch} x seq_len {args.seq_len}, "
          f"{torch.get_num_threads()} thread(s), interval {args.interval:g} s, {len(r['on'])} steps on / "
          f"{len(r['off'])} off (blocks of {args.block})")
    print(f"  median step: on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms, difference {(on - off) * 1e3:+.2f} ms "
          f"({(on - off) / off:+.2%}; step-to-step spread (stdev) {statistics.stdev(r['off']) / off:.1%})")
    print(f"  training thread (beacon writes per step): {r['beacon_s'] * 1e6:.2f} us = {r['beacon_s'] / off:.5%} of the step")
    cpu = r["monitor_cpu_per_s"]
    print(f"  liveness thread: {cpu * 1e3:.3f} ms CPU per second ({cpu:.4%} of a core); {cpu * off * 1e3:.3f} ms "
          f"per step, {cpu:.4%} of the step even if all of it took the training thread's place")


if __name__ == "__main__":
    main()
