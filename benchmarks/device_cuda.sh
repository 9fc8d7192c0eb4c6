#!/usr/bin/env bash
# One prepared run on a lent GPU machine (the workplace's device tool): the CUDA path that tafl's CPU machines
# cannot run, and issue 34's DP accuracy cost (the eps = inf and 8 rows) in the GPU's spare time.
#   1. installs the wheels staged in $STAGE/whl (tafl's dependencies the machine's image lacks) and onnxruntime-gpu
#      from $STAGE/ort_gpu.tar.xz (the wheel's files, xz-packed to fit the transfer limit) into $STAGE/site;
#   2. benchmarks/cuda_check.py on the packages in $STAGE/pkgs: CUDA vs CPU provider outputs and throughput, then
#      the service under `bentoml serve` on the GPU (providers it reports, /predict vs in-process, c = 32 load);
#   3. then, side by side: the serving and packaging tests on the GPU machine, and benchmarks/privacy_cost.sh with
#      DEVICE=cuda on DermaMNIST from $STAGE/medmnist (whatever finishes before $BUDGET s comes back).
# Everything it writes for the caller goes to $OUT (at most 8 files).
# Preparing $STAGE (2026-12-04, docs/results.md, "The CUDA path on a lent GPU"): the machine has torch (with CUDA 13's libraries), numpy, onnx
# and CPU onnxruntime, and no network. `pip download --no-deps --only-binary=:all: --python-version 3.12` of tafl's
# other dependencies (bentoml and its own, pydicom, highdicom, opacus, dp-accounting, medmnist, and for the OIP test
# tritonclient[http] with geventhttpclient, gevent and zope.*, ...) makes whl/
# (about 28 MiB); onnxruntime-gpu's wheel (256 MB) is over the 64 MiB a call may carry, so its files go as an
# xz-packed tar (194 MiB) split in parts, one carried folder per call into /tmp/stage on the warm machine, and the
# last call joins them and checks their sha256 before this script runs.
# Usage (on the device machine, in the repository root): STAGE=/tmp/stage OUT=... benchmarks/device_cuda.sh
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${STAGE:-/tmp/stage}
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-420}
t0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
mkdir -p "$OUT" "$STAGE/site"
{
  nvidia-smi -L; python3 -V
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STAGE/site" \
    "$STAGE"/whl/*.whl 2>&1 | grep -v -i warning | tail -5
  xz -dc "$STAGE/ort_gpu.tar.xz" | tar -x -C "$STAGE/site"
  echo "installed in $(( $(date +%s) - t0 )) s"
} > "$OUT/env.txt" 2>&1
export PYTHONPATH=$STAGE/site:$PWD PYTHONUNBUFFERED=1 BENTOML_DO_NOT_TRACK=True
command -v python > /dev/null || ln -s "$(command -v python3)" /usr/local/bin/python
python3 -c "import onnxruntime as o, torch; print('ort', o.__version__, o.__file__, o.get_available_providers()); \
print('torch', torch.__version__, torch.cuda.is_available())" >> "$OUT/env.txt" 2>&1

pkgs=("$STAGE"/pkgs/*)
timeout 200 python3 benchmarks/cuda_check.py "${pkgs[@]}" --service --requests 400 --repeats 20 --out "$OUT/check" \
  > "$OUT/cuda_check.log" 2>&1
echo "cuda_check rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
cp "$OUT/check/cuda_check.json" "$OUT/" 2>/dev/null
tail -c 20000 "$OUT/check/service.log" > "$OUT/service_tail.log" 2>/dev/null
rm -rf "$OUT/check"

# the rest of the budget: DP accuracy cost in the background, the GPU machine's test run in the foreground
# which rows at which epsilons (default: both rows at inf and 8): one background job per entry of
# PRIV_JOBS="ROW:EPS,EPS ROW:EPS", each with its own log)
PRIV_JOBS=${PRIV_JOBS:-"fedavg_la:inf,8 gtafl:inf,8"}
dps=()
for job in $PRIV_JOBS; do
  (SEEDS="1 2 3" EPS="$(echo "${job#*:}" | tr , ' ')" PAR=6 DEVICE=cuda timeout $(( $(left) - 25 )) \
     benchmarks/privacy_cost.sh "$STAGE/medmnist" "${job%%:*}" >> "$OUT/privacy.log" 2>&1) &
  dps+=($!)
done
timeout $(( $(left) - 40 )) python3 -m pytest -q -p no:cacheprovider tests/serving/test_service.py \
  tests/serving/test_dicom_sr_service.py tests/serving/test_oip.py tests/packaging tests/training/test_cuda.py -o faulthandler_timeout=120 > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
wait "${dps[@]}"
echo "privacy rc=$? at $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
tar -czf "$OUT/privacy_runs.tgz" benchmarks/out/priv_*/report.json benchmarks/out/priv_*/report.md \
  benchmarks/results/priv_*.json benchmarks/results/privacy_cost_*.md 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv >> "$OUT/env.txt" 2>&1
echo "done at $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
