#!/usr/bin/env bash
# bench.sh: run idem's side-by-side benchmarks in interleaved rounds.
#
#   scripts/bench.sh [ROUNDS] [BENCHTIME]     (defaults: 5 rounds, 3s)
#
# Each round runs every benchmark once (-count 1), so the bare client and idem
# alternate round after round and share whatever the machine is doing; the
# ratio of their medians is what docs/BENCHMARKS.md records. Raw output goes
# to bench.out; benchstat (golang.org/x/perf/cmd/benchstat), when installed,
# summarises it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=${1:-5}
benchtime=${2:-3s}
out=${BENCH_OUT:-bench.out}
: >"$out"
scripts/services.sh up postgres redis >/dev/null
for ((i = 1; i <= rounds; i++)); do
	echo "bench: round $i/$rounds (load: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
	go test -run '^$' -bench 'ClaimTx|ClaimBatch' -benchtime "$benchtime" -count 1 ./dedup/pgtable/ | grep -E '^(Benchmark|goos|goarch|pkg|cpu)' >>"$out"
	go test -run '^$' -bench 'Lease|ClaimBatch' -benchtime "$benchtime" -count 1 ./dedup/redisnx/ | grep -E '^(Benchmark|goos|goarch|pkg|cpu)' >>"$out"
done
if command -v benchstat >/dev/null 2>&1; then
	benchstat "$out"
else
	echo "bench: raw results in $out (install benchstat for a summary: go install golang.org/x/perf/cmd/benchstat@latest)" >&2
	cat "$out"
fi
