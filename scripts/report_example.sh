#!/usr/bin/env bash
# A real run with faults, drawn by `ftrun report`: the picture in the README (docs/report-example.svg).
# 4 workers train the example with --respawn. At step 150 rank 2 is killed; once its replacement has joined,
# rank 1 hangs (SIGSTOP: the watchdog dumps its stacks and kills it); once that one's replacement has joined,
# rank 3 raises an exception. Each time the survivors recover in place and the replacement rejoins.
# Usage: scripts/report_example.sh [OUTPUT.svg]   (about five minutes on 2 busy CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/report-example.svg}
logs=$(mktemp -d)
export XDG_RUNTIME_DIR=$logs/runtime
mkdir -p "$XDG_RUNTIME_DIR"
python -m ftrun --nproc-per-node 4 --respawn --hang-timeout 10 --log-dir "$logs" \
    examples/train_ddp.py --steps 3600 --width 256 >"$logs/out.txt" 2>"$logs/err.txt" &
job=$!
await() {  # wait until FILE holds COUNT lines matching PATTERN (or the job ended)
    until [ "$(cat $1 2>/dev/null | grep -c "$2")" -ge "$3" ]; do
        kill -0 $job 2>/dev/null || { cat "$logs/err.txt"; exit 1; }
        sleep 0.2
    done
}
await "$logs/out.txt" "step=150 " 1 && python -m ftrun inject kill --rank 2
await "$logs/*/events.jsonl" '"joiner ready"' 1 && python -m ftrun inject hang --rank 1
await "$logs/*/events.jsonl" '"joiner ready"' 2 && python -m ftrun inject exception --rank 3
wait $job
python -m ftrun report --log-dir "$logs" -o "$out"
