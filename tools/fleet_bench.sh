#!/usr/bin/env bash
# The fleet's measurements in one go (docs/fleet.md, "Measurements to take"), on a quiet machine:
#   1. 1 vs 2 replicas (--cpu-threads 1 each) behind vllm-router (round_robin), nanoflow's fcfs and
#      tokenflow, a burst and a Poisson load, through `bench.py --http` (counters summed over the
#      replicas the router lists);
#   2. cache_aware vs round_robin on multi-turn chat, 2 replicas: prefix hit rate, TTFT p50/p99;
#   3. the simulator's fleet (`bench.py --simulate --replicas 1|2`, round-robin) on the workloads
#      of 1, beside the real one.
# Every report goes to OUT/results.txt, every run's JSON to OUT/*.json, and a table of all of them
# ends results.txt. About 10 minutes with the demo model on a 2-core CPU (6 fleet starts).
#
#   pip install -e ".[fleet]"
#   tools/fleet_bench.sh [OUT]                     # OUT: default fleet-bench-<date>
#   FLEET_BENCH_SMOKE=1 tools/fleet_bench.sh OUT   # tiny sizes (~5 min): proves it runs, numbers mean nothing
#   FLEET_BENCH_SERVE_ARGS="--ckpt ./model" ...    # more flags for every replica
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-fleet-bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
RESULTS=$OUT/results.txt
SERVE_ARGS=${FLEET_BENCH_SERVE_ARGS:-}

if [[ -n ${FLEET_BENCH_SMOKE:-} ]]; then
    BURST="--burst 3 --prompt-len 16:2 --output-len 8:1 --read-rate 8"
    POISSON="--poisson 2 --duration 2 --prompt-len 16:2 --output-len 8:1 --read-rate 8"
    CHAT="--multi-turn 2 --turns 2 --think-time 0.5 --prompt-len 24:2 --output-len 8:1 --read-rate 8"
else
    BURST="--burst 24 --prompt-len 64:16 --output-len 64:8 --read-rate 8"
    POISSON="--poisson 0.75 --duration 20 --prompt-len 64:16 --output-len 64:8 --read-rate 8"
    CHAT="--multi-turn 8 --turns 3 --think-time 2 --prompt-len 48:8 --output-len 32:8 --read-rate 8"
fi

say() { echo "== $*" | tee -a "$RESULTS"; }

# fleet N ROUTER_POLICY NAME "BENCH ARGS;BENCH ARGS..." [-- replica flags]: one fleet, the bench
# runs in turn through its router; each writes OUT/NAME-<k>.json
fleet() {
    local n=$1 policy=$2 name=$3 runs=$4
    shift 4
    local cmd="" k=0
    IFS=';' read -ra workloads <<<"$runs"
    for w in "${workloads[@]}"; do
        cmd+="${cmd:+ && }python bench.py --http {url} $w --seed 1 --json $OUT/$name-$k.json"
        k=$((k + 1))
    done
    say "$name: $n replica(s), vllm-router $policy, replicas: $* $SERVE_ARGS"
    # shellcheck disable=SC2086
    python tools/fleet.py --replicas "$n" --port 0 --policy "$policy" --log-dir "$OUT/logs-$name" \
        --run "$cmd" -- "$@" $SERVE_ARGS 2>>"$OUT/stderr.log" | tee -a "$RESULTS"
}

start=$(date +%s)
for n in 1 2; do
    for policy in fcfs tokenflow; do
        fleet "$n" round_robin "real-x$n-$policy" "$BURST;$POISSON" --policy "$policy"
    done
done
for policy in round_robin cache_aware; do
    fleet 2 "$policy" "chat-$policy" "$CHAT"
done
for n in 1 2; do
    k=0
    for w in "$BURST" "$POISSON"; do
        say "sim-x$n-$k: the simulator's fleet, $n replica(s), round-robin: $w"
        # shellcheck disable=SC2086
        python bench.py --simulate --preset cpu-smollm2 --replicas "$n" --router round-robin \
            $w --seed 1 --json "$OUT/sim-x$n-$k.json" 2>>"$OUT/stderr.log" | tee -a "$RESULTS"
        k=$((k + 1))
    done
done
say "all runs took $(($(date +%s) - start)) s (k: 0 burst, 1 Poisson)"
python - "$OUT" <<'EOF' | tee -a "$RESULTS"
import json, pathlib, sys

keys = ("ttft_p50", "ttft_p99", "qoe_good_share", "throughput", "preemptions")
print(f"{'run':<34}" + "".join(f"{k:>16}" for k in (*keys, "prefix_hit_rate")))
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for name, m in json.loads(path.read_text())["policies"].items():
        hit = m["prefix_hit_tokens"] / max(1, m["prefix_queried_tokens"])
        cells = "".join(f"{m[k]:>16.3f}" for k in keys) + f"{hit:>16.1%}"
        print(f"{path.stem + '/' + name:<34}{cells}")
EOF
echo "results: $RESULTS"
