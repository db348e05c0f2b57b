"""A GPU session's parts merged into the files a device call brings back, and the table of what issue 52 asks
of a lease (`benchmarks/gpu_session.sh` runs it after each part, and at the end for the table).

1. Each part wrote WORK/<part>/gpu_kernels.json (`gpu_kernels.py`'s details) or rows.json (qmm's), and on a
   GPU WORK/<part>/autotune.txt (XLA's autotuning results; `sharding/autotune.py`).
2. `merge`: OUT/session.json holds every part's details in the order the parts ran; the autotuning files
   are joined into OUT/autotune_<chip>.txt, one entry per device and fusion (at most 8 files come back
   from a call: these two and session.log).
3. `decisions`, each from the parts it compares (a part that did not run leaves its lines out):
   - the bf16 step (e2e8) at 1 / 16 / 64 sequences: the least bytes it must move over its time, as a
     fraction of the copy's speed (target >= 0.80 at 1 and 16), beside the device's busy time against the
     wall time and the kernels' own fraction (the least bytes over the busy time);
   - int8 weight-only with XLA's products (int8x) and with the Pallas kernels (int8p) against e2e8's bf16
     step: the speed-up (target >= 1.6x at one sequence);
   - the verify step (spec8, with the drafts each sequence verified a step: 4 means 5-token steps) against
     e2e8's one-token step at one sequence (target <= 1.05x), in wall time and in device busy time;
   - moe8 against dense8a: step time at each count (issue 29's comparison, no target here);
   - qmm: per shape, the Pallas kernel's speed-up over XLA's product at 16 rows (a lone decode's padded
     step) and its error against the reference.
   Where a target is missed, the kernel that holds it: the busiest device kernel of the row's profile, or
   for a comparison the one whose time a step grew most over the baseline's.
4. The table, printed last (a device call's reply carries the end of its output).

    python3 benchmarks/gpu_session_summary.py WORK OUT --parts e2e8 int8x ... [--quiet]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sharding import autotune  # noqa: E402

TARGETS = dict(copy_fraction=0.80, int8_speedup=1.6, verify_ratio=1.05)


def chip_name(device_kind: str) -> str:
    """h100 / h200 / ... from a device kind such as 'NVIDIA H200' (the file name benchmarks/autotune keeps)."""
    found = re.search(r"\b([ABH]\d00)\b", device_kind, re.IGNORECASE)
    return found.group(1).lower() if found else re.sub(r"\W+", "_", device_kind.lower()).strip("_") or "gpu"


def merge(work: Path, out: Path, parts: list[str]) -> dict:
    """OUT/session.json and OUT/autotune_<chip>.txt from what the parts left under WORK."""
    session: dict = {"parts": {}}
    for part in parts:
        folder = work / part
        if (folder / "gpu_kernels.json").exists():
            session["parts"][part] = json.loads((folder / "gpu_kernels.json").read_text())
        elif (folder / "rows.json").exists():
            session["parts"][part] = {"rows": json.loads((folder / "rows.json").read_text())}
    found, unreadable = [], {}
    for part in parts:
        path = work / part / "autotune.txt"
        if path.exists():
            try:
                found.append(autotune.read_results(path))
            except autotune.AutotuneFileError as e:  # a dump cut short by a part's timeout, say
                unreadable[part] = str(e)
    if found or unreadable:
        kinds = [d["device"] for d in session["parts"].values() if "device" in d]
        name = f"autotune_{chip_name(kinds[0] if kinds else 'gpu')}.txt"
        merged = autotune.merge(found) if found else autotune.AutotuneResults({}, {})
        if merged.entries:
            (out / name).write_text(merged.text())
        session["autotune"] = dict(file=name if merged.entries else None, entries=len(merged.entries),
                                   devices=merged.devices(), unreadable=unreadable)
    (out / "session.json").write_text(json.dumps(session, indent=1))
    return session


def decode_rows(details: dict | None) -> dict[int, dict]:
    """A part's e2e decode rows that ran, by sequence count."""
    rows = (details or {}).get("timings", [])
    return {r["seqs"]: r for r in rows if r.get("bench") == "e2e decode" and "error" not in r}


def kernel_times(row: dict) -> dict[str, float]:
    """ms per step of each of the device's busiest kernels in a profiled row ({} where none ran on one)."""
    if "device" not in row:
        return {}
    return {name: ms for name, ms, _ in row["profile"]["processes"][row["device"]]["top"]}


def holder(row: dict, base: dict | None = None) -> str:
    """The kernel that holds a missed target: the busiest of `row`'s profile, or the one that grew most a
    step over `base`'s."""
    times = kernel_times(row)
    if not times:
        return "no device profile"
    before = kernel_times(base) if base else {}
    name, grown = max(((k, ms - before.get(k, 0.0)) for k, ms in times.items()), key=lambda kv: kv[1])
    return f"{name[:60]}, {times[name]:.3f} ms a step" + (f" (+{grown:.3f})" if base else "")


def verdict(ok: bool, row: dict, base: dict | None = None) -> str:
    return "met" if ok else f"MISSED; holds it: {holder(row, base)}"


def busy(row: dict) -> str:
    if "device_busy_ms" not in row:
        return ""
    return (f"; device busy {row['device_busy_ms']:.2f} ms = {row['busy_of_wall']:.2f} of wall, kernels at "
            f"{row['device_ratio']:.2f} of copy")


def decisions(session: dict) -> list[tuple[str, str, str, str]]:
    """(what, measured, target, verdict) lines of the table."""
    parts = session["parts"]
    bf16, lines = decode_rows(parts.get("e2e8")), []
    for n, row in sorted(bf16.items()):
        target = n in (1, 16)
        lines.append((f"bf16 step, {n} seq: least bytes / time, of copy",
                      f"{row['ratio']:.2f} ({row['ms']:.2f} ms{busy(row)})",
                      f">= {TARGETS['copy_fraction']:.2f}" if target else "",
                      verdict(row["ratio"] >= TARGETS["copy_fraction"], row) if target else ""))
    for part, products in (("int8x", "XLA"), ("int8p", "Pallas")):
        for n, row in sorted(decode_rows(parts.get(part)).items()):
            if n not in bf16:
                continue
            speedup = bf16[n]["ms"] / row["ms"]
            target = n == 1
            lines.append((f"int8 weight-only ({products}) vs bf16, {n} seq", f"{speedup:.2f}x ({row['ms']:.2f} ms)",
                          f">= {TARGETS['int8_speedup']}x" if target else "",
                          verdict(speedup >= TARGETS["int8_speedup"], row, bf16[n]) if target else ""))
    spec = decode_rows(parts.get("spec8"))
    if 1 in spec and 1 in bf16:
        row, base = spec[1], bf16[1]
        ratio = row["ms"] / base["ms"]
        device = (f"; device busy {row['device_busy_ms'] / base['device_busy_ms']:.2f}x"
                  if row.get("device_busy_ms") and base.get("device_busy_ms") else "")
        lines.append(("verify step (K=4) vs one-token step, 1 seq", f"{ratio:.2f}x ({row['ms']:.2f} ms, "
                      f"{row.get('drafts_per_step', 0):.1f} drafts verified a step{device})",
                      f"<= {TARGETS['verify_ratio']}x", verdict(ratio <= TARGETS["verify_ratio"], row, base)))
    idle = next((r for r in parts.get("spec8", {}).get("timings", []) if "idle_verify_ms" in r), None)
    if idle:  # the same program with and without draft rows, whether or not the decode rows' drafts came
        bucket = min(idle["idle_ms"], key=int)
        lines.append((f"idle {bucket}-token step verifying a draft a sequence vs none (spec8)",
                      f"{idle['idle_verify_ms'][bucket] / idle['idle_ms'][bucket]:.2f}x "
                      f"({idle['idle_verify_ms'][bucket]:.2f} against {idle['idle_ms'][bucket]:.2f} ms)", "", ""))
    dense = decode_rows(parts.get("dense8a"))
    for n, row in sorted(decode_rows(parts.get("moe8")).items()):
        if n in dense:
            lines.append((f"MoE vs dense of its active size, {n} seq", f"{row['ms'] / dense[n]['ms']:.2f}x "
                          f"({row['ms']:.2f} against {dense[n]['ms']:.2f} ms)", "", ""))
    for r in parts.get("qmm", {}).get("rows", []):
        if r.get("rows") == 16 and "speedup" in r:
            lines.append((f"int8 kernel vs XLA, {r['shape']} {r['k']}x{r['n']}, 16 rows",
                          f"{r['speedup']:.2f}x ({r['kernel_us']:.1f} us, {r['kernel_gbs']:.0f} GB/s; "
                          f"error {r.get('error_vs_reference', float('nan')):.1e})", "", ""))
    return lines


def table(session: dict, parts: list[str]) -> str:
    ran = session["parts"]
    kinds = {d["device"] for d in ran.values() if "device" in d}
    copies = [r["gbs"] for d in ran.values() for r in d.get("timings", []) if r.get("bench") == "copy" and "gbs" in r]
    out = [f"issue 52 on {', '.join(sorted(kinds)) or 'no device'}; copy "
           + (", ".join(f"{c:.0f}" for c in copies) + " GB/s" if copies else "not measured")]
    missing = [p for p in parts if p not in ran]
    if missing:
        out.append(f"no results from: {' '.join(missing)} (skipped or failed: see session.log)")
    for part, details in ran.items():
        failed = [c["check"] for c in details.get("checks", []) if not c["ok"]]
        errors = [f"{r['bench']} {r['config']}" for r in details.get("timings", []) if "error" in r]
        if failed or errors:
            out.append(f"{part}: FAILED checks {failed}; error rows {errors}"[:300])
    if "autotune" in session:
        a = session["autotune"]
        out.append(f"autotune: {a['entries']} entries -> {a['file']}" + (f"; unreadable: {a['unreadable']}"
                                                                         if a["unreadable"] else ""))
    out += ["", "| measured | value | target | verdict |", "|---|---|---|---|"]
    out += [f"| {' | '.join(line)} |" for line in decisions(session)]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, help="the folder the parts wrote into (WORK/<part>/...)")
    parser.add_argument("out", type=Path, help="where session.json and autotune_<chip>.txt go")
    parser.add_argument("--parts", nargs="*", required=True, help="the parts, in the order they run")
    parser.add_argument("--quiet", action="store_true", help="merge only, no table")
    args = parser.parse_args(argv)
    session = merge(args.work, args.out, args.parts)
    if not args.quiet:
        print(table(session, args.parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
