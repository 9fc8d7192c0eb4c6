#!/usr/bin/env bash
# ViT-DAFL evidence (issue 16): three seeds of DAFL vs focal vs CE, and DAFL's imbalance-aware vs
# sample-count aggregation, with the conv-tokenizer recipe (configs/dafl_conv_<set>.yaml).
# Usage: benchmarks/dafl_seeds.sh [SHARED_DATA] [derma|ham ...]; JOBS=2 runs two at a time
# (one torch thread each: on 2 shared cores, two threads per run ran up to 15x slower).
# Then: python benchmarks/dafl_summary.py ... (the command is printed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data}
shift || true
sets=${*:-derma}
jobs=${JOBS:-2}
out=benchmarks/out
mkdir -p $out
tasks=()
for s in $sets; do
  case $s in
    derma) cfg=configs/dafl_conv_dermamnist.yaml; root=$data/medmnist; tag=dermamnist ;;
    ham)   cfg=configs/dafl_conv_ham10000.yaml;   root=$data/ham10000; tag=ham10000 ;;
    *) echo "unknown set $s" >&2; exit 2 ;;
  esac
  for seed in 1 2 3; do tasks+=("$cfg $root dafl_s${seed}_$tag --seed $seed"); done
  for seed in 1 2 3; do tasks+=("$cfg $root dafl_ce_s${seed}_$tag --seed $seed --loss ce"); done
  for seed in 1 2 3; do tasks+=("$cfg $root dafl_focal_s${seed}_$tag --seed $seed --loss focal"); done
  for seed in 1 2 3; do tasks+=("$cfg $root dafl_sizeagg_s${seed}_$tag --seed $seed --aggregation size"); done
done
one() {
  set -- $1
  local cfg=$1 root=$2 name=$3; shift 3
  [[ -f $out/$name/report.json ]] && return 0
  rm -rf "${out:?}/$name"
  .venv/bin/tafl train --config "$cfg" --data-root "$root" --out $out/$name --threads 1 --no-progress "$@" \
      > $out/$name.log 2>&1 || echo "FAILED: $name (see $out/$name.log)" >&2
}
export -f one
export out
printf '%s\n' "${tasks[@]}" | xargs -P "$jobs" -I{} bash -c 'one "$@"' _ {}
for s in $sets; do
  case $s in derma) tag=dermamnist ;; ham) tag=ham10000 ;; esac
  echo "python benchmarks/dafl_summary.py --name dafl_seeds_$tag" \
       "DAFL=$out/dafl_s1_$tag,$out/dafl_s2_$tag,$out/dafl_s3_$tag" \
       "CE=$out/dafl_ce_s1_$tag,$out/dafl_ce_s2_$tag,$out/dafl_ce_s3_$tag" \
       "focal=$out/dafl_focal_s1_$tag,$out/dafl_focal_s2_$tag,$out/dafl_focal_s3_$tag" \
       "DAFL-size-agg=$out/dafl_sizeagg_s1_$tag,$out/dafl_sizeagg_s2_$tag,$out/dafl_sizeagg_s3_$tag"
done
