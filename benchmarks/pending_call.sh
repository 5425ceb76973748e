#!/usr/bin/env bash
# The device call the notes owe (NOTES, "What to do next", item 0), kept here because .whl/ is
# lost with the machine. Here: `bash benchmarks/fetch_wheels.sh`; then
#   run(command="bash benchmarks/pending_call.sh [minimal]", carry=[".whl"])
# 1. benchmarks/stream_overlap.py, both parts (serial / stream / grouped / tupled; the HLO of
#    each way under $OUT/<part>/): does the tuple-valued stream call overlap the gemms?
# 2. H200: issue 6's training figure (bench_train, DeltaNet and OSDN, 340M, 8 x 2048).
# 3. H100: ncu of osgm_bwd_mosaic, one profile read twice (SASS source page, stall table).
# "minimal": item 1 only, each part cut at 120 s (for a call on a small budget).
mode=${1:-full}
case $mode in full) limit=150 ;; minimal) limit=120 ;;
  *) echo "pending_call.sh: the argument must be 'minimal' or nothing, got '$mode'" >&2; exit 2 ;; esac
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $GPU"
for part in backward forward; do
  echo "== stream_overlap $part"
  timeout "$limit" python benchmarks/stream_overlap.py --part $part --hlo "$OUT/$part" \
    > "$OUT/so_$part.log" 2>&1
  tail -30 "$OUT/so_$part.log"
done
[ "$mode" = minimal ] && exit 0
if echo "$GPU" | grep -q H200; then bt a --preconditioners none osgm --steps 6 --no-parity; fi
if echo "$GPU" | grep -q H100; then
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  echo "== ncu osgm_bwd (one profile: its SASS source page, then its stall table)"
  timeout 200 ncu --profile-from-start off --clock-control none --kernel-name regex:"osgm_bwd_mosaic" \
    --launch-count 1 --section SourceCounters --section WarpStateStats --section LaunchStats \
    --section Occupancy --section SchedulerStats --section SpeedOfLight \
    --section MemoryWorkloadAnalysis -o /tmp/bwd \
    python benchmarks/ncu_kernels.py osgm --grad --inner > "$OUT/ncu_bwd.log" 2>&1
  tail -3 "$OUT/ncu_bwd.log"
  ncu -i /tmp/bwd.ncu-rep --page source --csv --print-source sass > "$OUT/bwd_sass.csv" 2>/dev/null
  python benchmarks/ncu_sass.py "$OUT/bwd_sass.csv" --ctas-warps 256 --top 25
  ncu -i /tmp/bwd.ncu-rep --page raw --csv > "$OUT/bwd_raw.csv" 2>/dev/null
  python benchmarks/ncu_stalls.py "$OUT/bwd_raw.csv" --top 6
fi
