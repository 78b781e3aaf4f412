#!/usr/bin/env bash
# The pre-registered replication (PREREGISTERED.md): two runs, then the analysis. Resumable: the
# same command picks up where an interrupted one stopped (each run's saved stages are reused).
# From the repository root: bash runs/replication-pythia/run.sh. REPLICATION_OUT names the folder
# for the two runs and their logs (default: beside this file). A session's machine is not kept:
# commit the saved stages (units, records, logs) before it ends.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=${REPLICATION_OUT:-runs/replication-pythia}
teacher=../shared/weights/standin-pythia
common=(--profile study --data ../shared/data --device cpu --seeds 5,6,7,8,9,10,11,12,13,14
        --budgets 32 --loss softmax --heldout-skip 112)
python reproduce.py "$teacher" "${common[@]}" --variants fix,dof,dof_mean,oracle_e2e \
    --out "$here/main" >> "$here/main.log" 2>&1
python reproduce.py "$teacher" "${common[@]}" --variants dof --lam 0.0625 \
    --out "$here/lam-0.0625" >> "$here/lam-0.0625.log" 2>&1
python runs/replication-pythia/analyse.py "$here" > "$here/RESULT.md"
