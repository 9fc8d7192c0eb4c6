#!/usr/bin/env bash
# The four-site HAM10000 run set (issue 33): HAM10000's four source hospitals as clients (the Fed-ISIC2019
# split, configs/sites_ham10000.yaml: ResNet-8 at quarter width (16-32-64 channels), 32 px, all four sites a
# round, 1 local epoch, 20 rounds, about 5 minutes a run on 2 cores), three seeds per row (seed by seed, so
# a stopped set still has every row), then one `tafl compare` whose per-site table gives pooled balanced
# accuracy and each site's own-mix accuracy. A seed changes the validation carve, the initialisation and every
# sampling draw; the sites and the test fold are the data's own.
# Usage: benchmarks/sites_ham10000.sh [DATA_ROOT] [ROW ...]
#   ROW: gtafl_cal (the config file as it stands, the recommendation: GTAFL + federated vector calibration)
#        | gtafl_trained (each expert its own CE head: the experts as first measured) | gtafl_vote_la (shifted
#        experts, the vote's common move chosen on validation) | fedavg_la (FedAvg + logit adjustment, tau on validation: the baseline) | fedavg (plain argmax)
#        | fedprox_la | creff_la | local_la (each site trains with its own logit adjustment) | pooled (one
#        model on every site's training rows: the centralised ceiling)
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-../shared/data/ham10000}
shift || true
rows=${*:-fedavg_la local_la pooled gtafl_cal}
seeds=${SEEDS:-1 2 3}
py=${PYTHON:-python}
# the single-head baselines: cross-entropy, decided at argmax(z - tau*log(train mix)) with tau on validation
single=(--decision validation --calibration none --calib_holdout 0)
for s in $seeds; do
for r in $rows; do
  case $r in
    fedavg)     args=(--method fedavg "${single[@]}" --decision argmax) ;;
    fedavg_la)  args=(--method fedavg "${single[@]}") ;;
    fedprox_la) args=(--method fedprox "${single[@]}") ;;
    creff_la)   args=(--method creff "${single[@]}") ;;
    local_la)   args=(--method fedavg "${single[@]}" --local_adjust 1.0) ;;
    gtafl_cal)  args=() ;;  # the config file as it stands: the recommended row
    gtafl_trained) args=(--expert_form trained --decision argmax) ;;  # the experts as first built (issue 33's runs)
    gtafl_vote_la) args=(--expert_form shifted --decision validation) ;;  # shifted experts, vote moved on validation
    pooled)     args=(--method fedavg "${single[@]}" --centralised true) ;;
    *) echo "unknown row $r" >&2; exit 2 ;;
  esac
  name=sites_${r}_s${s}
  if [[ -f benchmarks/out/$name/report.json && -z ${FORCE:-} ]]; then echo "$name: done already"; continue; fi
  $py benchmarks/train_bench.py --config configs/sites_ham10000.yaml --data-root "$root" "${args[@]}" \
    --name "$name" --seed "$s" 2>&1 | grep -v -e "UserWarning: The least populated" -e "warnings.warn(" || true
done
done
$py -m tafl.cli compare benchmarks/out/sites_*_s[0-9]* --out benchmarks/results/sites_ham10000.md --plot "" > /dev/null
$py benchmarks/sites_summary.py --recommend gtafl_cal > /dev/null
echo "tables: benchmarks/results/sites_ham10000.md (tafl compare), benchmarks/results/sites_summary.md"
