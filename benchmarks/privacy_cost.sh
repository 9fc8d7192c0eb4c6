#!/usr/bin/env bash
# The accuracy cost of record-level DP (issue 34): GTAFL and the best single-head configuration (FedAvg + logit
# adjustment, tau on validation) at epsilon = inf, 8, 3, 1 (delta 1e-5), three seeds, side by side, on
# configs/benchmark.yaml (DermaMNIST, 20 clients, 8 a round, 2 local epochs, 20 rounds). A DP run trains the GroupNorm
# ResNet-8 with DP-SGD and GTAFL runs --no-gs (docs/design.md, "What leaves a site"); the inf rows are the non-private configurations as
# they stand (BatchNorm, GI-GDS on). Full width is a GPU job (a FedAvg run is about 46 minutes on 2 cores without DP,
# DP-SGD costs 2-5x that); WIDTH=0.5 quarters the compute.
# SCOPE=head: the sites train the classifier head only, every row including inf (--train_scope head, the DP default
# since 2026-12-06: docs/decisions.md, "The head under DP"); SCOPE=all: the whole network in every DP row (docs/results.md, "DP-SGD over the whole network").
# Usage: benchmarks/privacy_cost.sh [DATA_ROOT] [ROW ...]   ROW: gtafl | fedavg_la | lda | lda_secure ; EPS="inf 8 3 1" SEEDS="1 2 3"
#        PAR=2 (two runs side by side, one thread each), WIDTH=0.5, CONFIG=configs/sites_ham10000.yaml (with
#        DATA_ROOT=../shared/data/ham10000: the four real sites), DEVICE=cuda (on a GPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-../shared/data/medmnist}
shift || true
rows=${*:-fedavg_la gtafl}
eps_list=${EPS:-inf 8 3 1}
seeds=${SEEDS:-1 2 3}
par=${PAR:-1}
config=${CONFIG:-configs/benchmark.yaml}
width=${WIDTH:-}
scope=${SCOPE:-all}
tag=$(basename "$config" .yaml)${width:+_w$width}
[[ $scope == head ]] && tag=${tag}_head
jobs=()
for s in $seeds; do
for e in $eps_list; do
for r in $rows; do
  case $r in
    fedavg_la) args=(--method fedavg --decision validation --calibration none --calib_holdout 0) ;;
    gtafl)     args=(--method gtafl --decision validation --calibration none --calib_holdout 0) ;;
    lda)       args=(--method lda --decision validation --calibration none --calib_holdout 0) ;;
    # lda under SecAgg+ on Flower: every site in one secure sum, the DP noise split over its sites
    lda_secure) args=(--method lda --decision validation --calibration none --calib_holdout 0 --engine flower
                      --secure_aggregation true --frac 1 --rounds 1) ;;
    *) echo "unknown row $r" >&2; exit 2 ;;
  esac
  if [[ $e != inf ]]; then
    args+=(--dp_epsilon "$e")
    [[ $r == gtafl ]] && args+=(--gs false)
  fi
  [[ $scope == head || $e != inf ]] && args+=(--train_scope "$scope")
  [[ -n $width ]] && args+=(--width "$width")
  [[ -n ${DEVICE:-} ]] && args+=(--device "$DEVICE")
  name=priv_${r}_e${e}_s${s}_${tag}
  if [[ -f benchmarks/out/$name/report.json && -z ${FORCE:-} ]]; then echo "$name: done already"; continue; fi
  threads=(); (( par > 1 )) && threads=(--threads 1)
  jobs+=("python benchmarks/train_bench.py --config $config ${args[*]} --data-root $root --name $name --seed $s ${threads[*]}")
done
done
done
if (( ${#jobs[@]} )); then printf '%s\n' "${jobs[@]}" | xargs -d '\n' -P "$par" -I{} bash -c '{}'; fi
python -m tafl.cli compare benchmarks/out/priv_*_s[0-9]*_"$tag" --out benchmarks/results/privacy_cost_"$tag".md --plot "" > /dev/null
echo "table: benchmarks/results/privacy_cost_$tag.md"
