#!/usr/bin/env bash
# The replication of the GTAFL paper's finding on DermaMNIST (issue 3): FedAvg, CReFF, GTAFL and the
# Table IV ablation, one run each with the same seed and data split (configs/benchmark.yaml:
# paper-width ResNet-8, 32x32, natural long tail, 20 clients, 8 per round, 2 local epochs, 20 rounds).
# Usage: benchmarks/replicate_dermamnist.sh [DATA_ROOT] [RUN ...]   (RUN: fedavg creff gtafl nocl nogs noen nocr)
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-../shared/data/medmnist}
shift || true
runs=${*:-fedavg creff gtafl nocl nogs noen nocr}
for r in $runs; do
  case $r in
    fedavg) python benchmarks/train_bench.py --method fedavg --data-root "$root" --name fedavg_dermamnist ;;
    creff)  python benchmarks/train_bench.py --method creff  --data-root "$root" --name creff_dermamnist ;;
    gtafl)  python benchmarks/train_bench.py --method gtafl  --data-root "$root" --name gtafl_dermamnist ;;
    nocl)   python benchmarks/train_bench.py --method gtafl  --data-root "$root" --name gtafl_nocl_dermamnist --cl false ;;
    nogs)   python benchmarks/train_bench.py --method gtafl  --data-root "$root" --name gtafl_nogs_dermamnist --gs false ;;
    noen)   python benchmarks/train_bench.py --method gtafl  --data-root "$root" --name gtafl_noen_dermamnist --en false ;;
    nocr)   python benchmarks/train_bench.py --method gtafl  --data-root "$root" --name gtafl_nocr_dermamnist --cr false ;;
    *) echo "unknown run $r" >&2; exit 2 ;;
  esac
done
