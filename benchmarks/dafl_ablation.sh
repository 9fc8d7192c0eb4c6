#!/usr/bin/env bash
# ViT-DAFL ablation (issue 4): DAFL vs cross-entropy vs focal loss, and DAFL's imbalance-aware
# aggregation vs FedAvg's size weighting; one run each, same seed and split, on DermaMNIST and on
# HAM10000 at 64x64. Usage: benchmarks/dafl_ablation.sh [SHARED_DATA] [derma|ham ...]
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data}
shift || true
sets=${*:-derma ham}
for s in $sets; do
  case $s in
    derma) cfg=configs/dafl_dermamnist.yaml; root=$data/medmnist; tag=dermamnist ;;
    ham)   cfg=configs/dafl_ham10000.yaml;   root=$data/ham10000; tag=ham10000 ;;
    *) echo "unknown set $s" >&2; exit 2 ;;
  esac
  python benchmarks/train_bench.py --method dafl --config $cfg --data-root "$root" --name dafl_$tag
  python benchmarks/train_bench.py --method dafl --config $cfg --data-root "$root" --name dafl_ce_$tag --loss ce
  python benchmarks/train_bench.py --method dafl --config $cfg --data-root "$root" --name dafl_focal_$tag --loss focal
  python benchmarks/train_bench.py --method dafl --config $cfg --data-root "$root" --name dafl_sizeagg_$tag --aggregation size
done
