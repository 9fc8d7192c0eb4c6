#!/usr/bin/env bash
# The measurements behind the GFF decisions of docs/decisions.md, "GTAFL's experts" (issue 12), on validation data:
# three GTAFL runs without SimCLR (seeds 7, 8, 9; configs/benchmark.yaml, all round checkpoints kept,
# about 8 minutes each on 2 cores), then the server's expert loop replayed exactly on the features their
# clients embedded (benchmarks/gff_replay.py), twice per run with other server-side random draws, for each
# variant in benchmarks/variants/*.json (about 20 minutes per sweep with 2 processes).
# Usage: benchmarks/gff_decisions.sh [DATA_ROOT]
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-../shared/data/medmnist}
runs=()
for s in 7 8 9; do
  out=benchmarks/out/dev_gs_s$s
  if [[ ! -f $out/report.json ]]; then
    python benchmarks/train_bench.py --method gtafl --data-root "$root" --name dev_gs_s$s --out "$out" --cl false \
      --keep_checkpoints 20 --seed $s
  fi
  runs+=("$out")
done
python benchmarks/gff_replay.py record "${runs[@]}"
python benchmarks/gff_replay.py sweep "${runs[@]}" --variants benchmarks/variants/gff_banks.json \
  --name gff_replay_banks --server-seeds 2 --procs 2
python benchmarks/gff_replay.py sweep "${runs[@]}" --variants benchmarks/variants/gff_lambda_epochs.json \
  --name gff_replay_lambda_epochs --server-seeds 2 --procs 2
