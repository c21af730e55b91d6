#!/usr/bin/env bash
# The GPU checks of the lookback kernel in one call, on a CUDA machine, from the source tree: the CUDA tests (the
# kernel compiled, not interpreted; graph-captured recording in float32), then bench_lookback_gpu.py (sweep,
# attention, generation). certrag's native core is not needed for these paths, so nothing is built: a shim package
# puts the source tree's certrag/ and kernels/ (as certrag.kernels) on the path. Results go to $OUT (default
# ./gpu-out); extra arguments go to the benchmark. Usage: OUT=dir COMMIT=sha bash benchmarks/gpu_check.sh [args]
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/gpu-out}
mkdir -p "$OUT"
SHIM=$(mktemp -d)
mkdir -p "$SHIM/certrag"
printf '__path__ = ["%s/certrag", "%s/certrag"]\n' "$REPO" "$SHIM" > "$SHIM/certrag/__init__.py"
ln -s "$REPO/kernels" "$SHIM/certrag/kernels"
export PYTHONPATH="$SHIM" PYTHONUNBUFFERED=1
cd "$REPO"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv \
    | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
# from the shim's folder: `python3 -m pytest` puts the working folder first on sys.path, and from the repository
# that would be the source tree's certrag (which imports the native core) instead of the shim
(cd "$SHIM" && python3 -m pytest -q -p no:cacheprovider --noconftest --rootdir "$REPO" -k "not real_small_model and not p_correct and not engine_answers" \
    "$REPO/tests/kernels/test_lookback_kernel.py" "$REPO/tests/certify/test_lookback.py") > "$OUT/tests.log" 2>&1
echo "tests: exit $? in $(( $(date +%s) - start )) s: $(tail -1 "$OUT/tests.log")"
start=$(date +%s)
python3 benchmarks/bench_lookback_gpu.py --out "$OUT/results.json" --commit "${COMMIT:-unknown}" "$@" \
    > "$OUT/bench.log" 2>&1
echo "bench: exit $? in $(( $(date +%s) - start )) s"
grep -v "^{" "$OUT/bench.log" | grep -iv "warn" | tail -20
python3 - "$OUT/results.json" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))
print("tuned:", run["meta"].get("sweep", {}).get("tuned"))
for r in run["rows"]:
    if r["part"] == "attention":
        print(f"{r['layout']:>13} B{r['batch']} L{r['length']:>6} err {r['max_error']:.1e} | graph us: sdpa "
              f"{r['sdpa_graph_us']:.1f} fused {r['fused_graph_us']:.1f} ({r['fused_graph_us'] / r['sdpa_graph_us']:.2f}x) "
              f"masses+sdpa {r['sdpa_masses_graph_us'] / r['sdpa_graph_us']:.2f}x | launched: sdpa {r['sdpa_us']:.1f} "
              f"fused {r['fused_us']:.1f} | {r['fused_gbps']:.0f} vs {r['sdpa_gbps']:.0f} GB/s")
    else:
        p = r["plain_ms_per_token"]
        gp = r.get("graph_plain_ms_per_token")
        print(f"gen {r['dtype']} L{r['length']}: plain {p:.2f} ms rec {r['record_kernel_ms_per_token'] / p:.2f}x "
              f"fused {r['record_fused_ms_per_token'] / p:.2f}x | graph plain {gp:.2f} ms rec "
              f"{r['graph_record_ms_per_token'] / gp:.2f}x fused {r['graph_fused_ms_per_token'] / gp:.2f}x | same: "
              + " ".join(f"{k[:-12]}={v}" for k, v in r.items() if k.endswith("_same_tokens")))
PY
