"""bench_step.py's report: derived figures, the ratios against the anchor case of the same run,
the verdicts against the targets, and the table on stdout."""
from __future__ import annotations

#: The plain-PyTorch case every ratio is taken against (measured in the same run).
ANCHOR_CASE = "compile_masked"
#: kernels.compile of each engine case
ENGINE_CASES = {"engine": "none", "engine_compile": "layers", "engine_compile_model": "model"}
#: Targets of the project's path (engine cases), judged only at the reference shape on CUDA.
TARGETS = {"tokens_per_s": 300_000, "speedup_vs_anchor": 1.2, "peak_gib": 20.0, "engine_overhead": 0.05}


def derive(results: dict, peak: dict, nominal: float | None, fpt: float) -> None:
    for r in results.values():
        if r.get("status") != "ok":
            continue
        r["model_tflops"] = r["tokens_per_s"] * fpt / 1e12
        r["mfu_measured"] = r["model_tflops"] / peak["tflops"] if peak.get("tflops") else None
        r["mfu_nominal"] = r["model_tflops"] / nominal if nominal else None


def _tps(results: dict, name: str) -> float | None:
    r = results.get(name)
    return r["tokens_per_s"] if r and r.get("status") == "ok" else None


def comparisons(results: dict) -> dict:
    """Per ok case: its speed against the anchor case of this run; per engine case also its
    overhead against the hand loop with the same kernels (step-time ratio - 1)."""
    anchor, manual = _tps(results, ANCHOR_CASE), _tps(results, "manual")
    out = {}
    for name in results:
        tps = _tps(results, name)
        if tps is None:
            continue
        c = {}
        if anchor and name != ANCHOR_CASE:
            c["speedup_vs_anchor"] = tps / anchor
        if manual and name in ENGINE_CASES:
            c["overhead_vs_manual"] = manual / tps - 1.0
        if c:
            out[name] = c
    return out


def _verdict(value, ok: bool | None, reference_shape: bool) -> str:
    if not reference_shape:
        return "n/a (not the 200m/2048/16/bf16 CUDA shape)"
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def targets(results: dict, comps: dict, reference_shape: bool) -> list[dict]:
    rows = []
    for eng in ENGINE_CASES:
        r = results.get(eng)
        if not r or r.get("status") != "ok":
            continue
        c = comps.get(eng, {})
        vs, over, peak = c.get("speedup_vs_anchor"), c.get("overhead_vs_manual"), r.get("peak_gib")
        checks = [
            ("tokens/s >= 300,000", r["tokens_per_s"], r["tokens_per_s"] >= TARGETS["tokens_per_s"]),
            (f"speed-up vs {ANCHOR_CASE} (same run) >= 1.2x", vs,
             None if vs is None else vs >= TARGETS["speedup_vs_anchor"]),
            ("peak memory <= 20 GiB", peak, None if peak is None else peak <= TARGETS["peak_gib"]),
            ("engine overhead vs manual <= 5 %", over, None if over is None else over <= TARGETS["engine_overhead"]),
        ]
        for what, value, ok in checks:
            rows.append({"case": eng, "target": what, "value": value,
                         "verdict": _verdict(value, ok, reference_shape)})
    return rows


def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def _header(m: dict) -> None:
    peak = m["matmul_peak"]
    v = m["versions"]
    print(f"\nbench_step: {m['device_name']} | torch {v['torch']} | deepspeed {v['deepspeed']} | triton "
          f"{v['triton']} | liger {v['liger-kernel']}")
    print(f"shape: preset {m['preset']}, seq {m['seq_len']}, micro batch {m['micro_batch']}, grad accum "
          f"{m['grad_accum']}, {m['precision']}, activation checkpointing {m['activation_checkpointing']}, "
          f"{m['tokens_per_step']:,} tokens/step, warm-up {m['warmup']}, timed {m['steps']}")
    print(f"FLOPs/token: {m['flops_per_token']:.4g} ({m['flops_source']})")
    print(f"peak: measured {peak['tflops']:.4g} TFLOP/s ({peak['size']}^3 {peak['dtype']} matmul), nominal "
          f"{_fmt(m['nominal_tflops'], '.1f', 'unknown')}{' TFLOP/s' if m['nominal_tflops'] else ''}")


def _table(cases: dict, comps: dict) -> None:
    head = (f"{'case':<22}{'status':<8}{'step ms':>10}{'tokens/s':>12}{'vs anchor':>10}{'TFLOP/s':>9}"
            f"{'MFU meas':>9}{'peak GiB':>9}{'before':>7}  backends")
    print("\n" + head)
    print("-" * len(head))
    for r in cases.values():
        if r["status"] != "ok":
            print(f"{r['case']:<22}{r['status']:<8}  {(r.get('reason') or r.get('error', ''))[:110]}")
            continue
        backends = " ".join(f"{k}={v}" for k, v in (r.get("backends") or {}).items())
        vs = comps.get(r["case"], {}).get("speedup_vs_anchor")
        print(f"{r['case']:<22}{'ok':<8}{r['step_s_median'] * 1e3:>10.2f}{r['tokens_per_s']:>12,.0f}"
              f"{_fmt(vs, '.2f') + ('x' if vs else ''):>10}{r['model_tflops']:>9.3g}{_fmt(r['mfu_measured'], '.1%'):>9}"
              f"{_fmt(r.get('peak_gib'), '.2f'):>9}{_fmt(r.get('mem_before_gib'), '.2f'):>7}  {backends}")


def print_report(report: dict) -> None:
    _header(report["meta"])
    _table(report["cases"], report["comparisons"])
    for name, c in report["comparisons"].items():
        if "overhead_vs_manual" in c:
            print(f"{name}: overhead vs manual {c['overhead_vs_manual']:+.1%}")
    if report["targets"]:
        print("\ntargets")
        for t in report["targets"]:
            v = t["value"]
            shown = "-" if v is None else (f"{v:+.1%}" if "overhead" in t["target"] else f"{v:,.3g}")
            print(f"  {t['case']:<22}{t['target']:<46}{shown:>12}  {t['verdict']}")
    for r in report["cases"].values():
        prof = r.get("profile")
        if prof:
            print(f"\n{r['case']}: one step profiled, {prof['ops']:,} ops; costliest by {prof['sorted_by']}:")
            for op in prof["top"]:
                print(f"  {op['name'][:60]:<60}{op['count']:>7} x {op['self_cpu_ms']:>9.2f} ms host "
                      f"{op['self_device_ms']:>9.2f} ms device")
    for r in report["cases"].values():
        if r["status"] in ("error", "oom", "crashed", "timeout"):
            print(f"\n--- {r['case']} {r['status']}: {r.get('error', '')}\n{r.get('traceback', '')}")
