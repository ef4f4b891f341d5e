"""Simulator fidelity on the public GH200 runs: fitted on OPT-350 only, GPT-Neo-2.7B held out.

Reads ../shared/reference/sailor/validation/{gh200-opt350,gh200-gptneo} with the Sailor profiles
and network fits next to them and runs `sailor.simulator.fidelity.validate_sets` twice:
1. with the shipped constants (`simulator.calibration`, fitted on gh200-opt350 only), gh200-gptneo
   held out: never fitted on, not even in a leave-one-out;
2. refitting the constants on gh200-opt350 now (`--fit`), to show they are the shipped ones and that
   nothing of gh200-gptneo enters them; leave-one-out per OPT-350 run and leave-one-model-out
   (GPT-Neo from constants fitted on OPT-350 alone).
Prints a table per set (targets of issue 15: gh200-gptneo time and memory mean |error| <= 6 %, max
<= 15 %; gh200-opt350 <= 5 % each), the worst runs, and as the last line one JSON object.

    python benchmarks/fidelity.py [--shared ../shared] [--no-refit]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

TARGETS = {"gh200-gptneo": {"time": 6.0, "memory": 6.0, "max": 15.0}, "gh200-opt350": {"time": 5.0, "memory": 5.0}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared"))
    ap.add_argument("--no-refit", action="store_true", help="skip the refit on OPT-350 (about a minute)")
    args = ap.parse_args()
    from sailor.perf.profiles import load_profiles
    from sailor.simulator.fidelity import load_run_set, validate_sets

    ref = Path(args.shared) / "reference" / "sailor"
    if not ref.is_dir():
        raise SystemExit(f"Sailor reference data not found at {ref} (pass --shared)")
    opt = load_run_set(ref / "validation" / "gh200-opt350")
    neo = load_run_set(ref / "validation" / "gh200-gptneo")
    profiles = {s.model: load_profiles(ref / "profiles", s.runs[0].job) for s in (opt, neo)}
    t0 = time.perf_counter()
    shipped = validate_sets([opt, neo], profiles, ref / "network", held_out={neo.name}, loo=False)
    refit = None if args.no_refit else validate_sets([opt, neo], profiles, ref / "network", held_out={neo.name},
                                                     fit=True)
    took = time.perf_counter() - t0

    print(f"{'set':<28} {'runs':>4} {'time mean |err| (%)':>20} {'memory mean |err| (%)':>22}"
          f" {'max, time or memory (%)':>24}  target")
    rows = {}
    for s in shipped.sets:
        m = s.report.summary()
        worst = max(m["time_max_ape_pct"], m["memory_max_ape_pct"])
        t = TARGETS.get(s.name, {})
        target = (f"<= {t['time']:g} / {t['memory']:g}" + (f" / {t['max']:g}" if "max" in t else " / -")) if t else ""
        label = f"{s.name} ({'not fitted' if s.held_out else 'fitted'})"
        print(f"{label:<28} {m['runs']:>4} {m['time_mape_pct']:>20.1f} {m['memory_mape_pct']:>22.1f} {worst:>24.1f}  {target}")
        met = bool(t) and m["time_mape_pct"] <= t["time"] and m["memory_mape_pct"] <= t["memory"] and \
            worst <= t.get("max", float("inf"))
        rows[s.name] = {"runs": m["runs"], "held_out": s.held_out, "time_mape_pct": m["time_mape_pct"],
                        "time_max_ape_pct": m["time_max_ape_pct"], "memory_mape_pct": m["memory_mape_pct"],
                        "memory_max_ape_pct": m["memory_max_ape_pct"], "target_met": met,
                        "worst": sorted(((r.name, round(r.time_err_pct, 1), round(r.memory_err_pct, 1))
                                         for r in s.report.results),
                                        key=lambda x: -max(abs(x[1]), abs(x[2])))[:3]}
    for name, r in rows.items():
        print(f"  {name} worst runs (time %, memory %): " + ", ".join(f"{n} {t:+.1f} / {m:+.1f}" for n, t, m in r["worst"]))
    out = {"sets": rows, "calibration": shipped.calibration}
    if refit is not None:
        opt_fit = next(s for s in refit.sets if s.name == opt.name).report.summary()
        lomo = refit.leave_one_model_out.get(neo.model)
        print(f"refit on {opt.name}: leave-one-out time mean {opt_fit['loo_time_mape_pct']:.1f} %"
              f" (max {opt_fit['loo_time_max_ape_pct']:.1f} %), memory mean {opt_fit['loo_memory_mape_pct']:.1f} %")
        if lomo:
            lm = lomo.summary()
            print(f"leave-one-model-out {neo.model} (fitted on {opt.model} only): time mean {lm['time_mape_pct']:.1f} %,"
                  f" memory mean {lm['memory_mape_pct']:.1f} %")
        out |= {"refit_calibration": refit.calibration, "opt350_loo_time_mape_pct": opt_fit["loo_time_mape_pct"],
                "opt350_loo_memory_mape_pct": opt_fit["loo_memory_mape_pct"],
                "gptneo_leave_one_model_out": lomo.summary() if lomo else None}
    print(json.dumps(out | {"seconds": took}))


if __name__ == "__main__":
    main()
