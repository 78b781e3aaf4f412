#!/usr/bin/env bash
# The fine-tuned table again (issue 55, item 5): runs/standin-gpt2-finetune's settings, with the
# learning rate and the best epoch chosen on a selection split held out of the training examples
# and the accuracy reported on the evaluation split alone. Resumable: the same command picks up
# where an interrupted one stopped. From the repository root: bash
# runs/standin-gpt2-finetune-select/run.sh. FINETUNE_OUT names the run's folder (default: beside
# this file). A session's machine is not kept: commit the folder's saved stages before it ends.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${FINETUNE_OUT:-runs/standin-gpt2-finetune-select/run}
mkdir -p "$out"
python reproduce.py ../shared/weights/standin-gpt2 --profile default --data ../shared/data \
    --device cpu --seeds 0,1,2 --budgets 64 --loss softmax \
    --variants performer,dijiang,fix,dof,dof_clip --limit 100 --finetune \
    --out "$out" >> "$out.log" 2>&1
