#!/usr/bin/env bash
# Every row of docs/results.md, "GTAFL and CReFF on DermaMNIST" over three seeds (issue 12): FedAvg, CReFF as published, CReFF + statistics,
# GTAFL and its ablations, each on configs/benchmark.yaml (DermaMNIST, natural long tail, paper-width ResNet-8 at
# 32 px, 20 clients, 8 a round, 2 local epochs, 20 rounds: on 2 cores about 16 minutes a GTAFL run and 46 a FedAvg
# run, whose clients train on every image where GI-GDS samples fewer). A seed changes
# the client partition, the initialisation and every sampling draw. Then one `tafl compare` over all runs: rows
# are configurations, cells mean ± sd over the seeds.
# Usage: benchmarks/seeds_dermamnist.sh [DATA_ROOT] [ROW ...]   (ROW: fedavg creff creff_stats gtafl nocl nogs noen
#        | issue 33's rows: fedavg_la fedprox_la creff_la (cross-entropy decided at argmax(z - tau*log pi), tau
#        on validation: the baseline every claim is measured against), gtafl_cal (GTAFL, its vote moved on
#        validation, + federated vector calibration, 10 % hold-out, the smoothed estimator) and gtafl_trained_cal
#        (the same with the experts as first built, each its own CE head, and the plain vote))
#        PAR=2 keeps two runs going side by side (one torch thread each); WIDTH=0.5 trains the ResNet-8 at half
#        width (about a quarter of the compute: FedAvg about 12 minutes a run instead of 46 here).
#        PYTHON picks the interpreter (default: python on PATH).
#        SEEDS="1 2 3" (default) picks the seeds; DATASET=pneumoniamnist (any MedMNIST flag in DATA_ROOT) runs the
#        same protocol on another dataset (natural long tail, the same config otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-../shared/data/medmnist}
shift || true
rows=${*:-fedavg creff creff_stats gtafl nocl nogs noen}
seeds=${SEEDS:-1 2 3}
dataset=${DATASET:-dermamnist}
par=${PAR:-1}
py=${PYTHON:-python}  # PYTHON=.venv/bin/python: the interpreter the runs use
width=${WIDTH:-}  # WIDTH=0.5: the ResNet-8 at that width (runs named ROW_w0.5_sS_DATASET), for a set that fits a session
tag=${width:+_w$width}
jobs=()
for s in $seeds; do
for r in $rows; do
  case $r in
    fedavg)      args=(--method fedavg) ;;
    creff)       args=(--method creff) ;;
    creff_stats) args=(--method creff --gff_centre true --final_round_frac 1.0) ;;
    gtafl)       args=(--method gtafl) ;;
    nocl)        args=(--method gtafl --cl false) ;;
    nogs)        args=(--method gtafl --gs false) ;;
    noen)        args=(--method gtafl --en false) ;;
    fedavg_la)   args=(--method fedavg --decision validation) ;;
    fedprox_la)  args=(--method fedprox --decision validation) ;;
    creff_la)    args=(--method creff --decision validation) ;;
    gtafl_cal)   args=(--method gtafl --calibration vector --calib_holdout 0.1 --decision validation) ;;
    gtafl_trained_cal) args=(--method gtafl --calibration vector --calib_holdout 0.1 --expert_form trained) ;;
    *) echo "unknown row $r" >&2; exit 2 ;;
  esac
  [[ -n $width ]] && args+=(--width "$width")
  name=${r}${tag}_s${s}_${dataset}
  if [[ -f benchmarks/out/$name/report.json && -z ${FORCE:-} ]]; then echo "$name: done already"; continue; fi
  threads=(); (( par > 1 )) && threads=(--threads 1)
  jobs+=("$py benchmarks/train_bench.py ${args[*]} --data-root $root --name $name --seed $s --dataset $dataset ${threads[*]}")
done
done
# a pool of PAR runs: the next starts as soon as one ends
if (( ${#jobs[@]} )); then printf '%s\n' "${jobs[@]}" | xargs -d '\n' -P "$par" -I{} bash -c '{}'; fi
if [[ -n $tag ]]; then  # a reduced-width set is compared on its own
  $py -m tafl.cli compare benchmarks/out/*"$tag"_s[0-9]*_"$dataset" --out benchmarks/results/seeds_"$dataset$tag".md \
    --plot "" > /dev/null
  echo "tables: benchmarks/results/seeds_$dataset$tag.md"
else
  $py -m tafl.cli compare benchmarks/out/*_s[0-9]*_"$dataset" --out benchmarks/results/seeds_"$dataset".md \
    --plot docs/"$dataset"_seeds.png > /dev/null
  echo "tables: benchmarks/results/seeds_$dataset.md"
fi
