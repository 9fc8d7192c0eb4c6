#!/usr/bin/env bash
# Every row of docs/results.md §2 over three seeds (issue 12): FedAvg, CReFF as published, CReFF + statistics,
# GTAFL and its ablations, each on configs/benchmark.yaml (DermaMNIST, natural long tail, paper-width ResNet-8 at
# 32 px, 20 clients, 8 a round, 2 local epochs, 20 rounds: about 8 to 10 minutes a run on 2 cores). A seed changes
# the client partition, the initialisation and every sampling draw. Then one `tafl compare` over all runs: rows
# are configurations, cells mean ± sd over the seeds.
# Usage: benchmarks/seeds_dermamnist.sh [DATA_ROOT] [ROW ...]   (ROW: fedavg creff creff_stats gtafl nocl nogs noen)
#        SEEDS="1 2 3" (default) picks the seeds; DATASET=pneumoniamnist (any MedMNIST flag in DATA_ROOT) runs the
#        same protocol on another dataset (natural long tail, the same config otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-../shared/data/medmnist}
shift || true
rows=${*:-fedavg creff creff_stats gtafl nocl nogs noen}
seeds=${SEEDS:-1 2 3}
dataset=${DATASET:-dermamnist}
for r in $rows; do
  case $r in
    fedavg)      args=(--method fedavg) ;;
    creff)       args=(--method creff) ;;
    creff_stats) args=(--method creff --gff_centre true --final_round_frac 1.0) ;;
    gtafl)       args=(--method gtafl) ;;
    nocl)        args=(--method gtafl --cl false) ;;
    nogs)        args=(--method gtafl --gs false) ;;
    noen)        args=(--method gtafl --en false) ;;
    *) echo "unknown row $r" >&2; exit 2 ;;
  esac
  for s in $seeds; do
    name=${r}_s${s}_${dataset}
    if [[ -f benchmarks/out/$name/report.json && -z ${FORCE:-} ]]; then echo "$name: done already"; continue; fi
    python benchmarks/train_bench.py "${args[@]}" --data-root "$root" --name "$name" --seed "$s" --dataset "$dataset"
  done
done
python -m tafl.cli compare benchmarks/out/*_s[0-9]*_"$dataset" --out benchmarks/results/seeds_"$dataset".md \
  --plot docs/"$dataset"_seeds.png > /dev/null
echo "tables: benchmarks/results/seeds_$dataset.md"
