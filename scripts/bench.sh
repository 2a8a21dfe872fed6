#!/usr/bin/env bash
# bench.sh: idem's benchmark table (test/bench), every row side by side with
# its baseline, the SQL floors of the database paths (pgbench), and the
# Redis rows' commands and the MariaDB row's statements sent by hand.
#
#   scripts/bench.sh [-quick] [-rounds N] [-only REGEXP]
#
# It builds the harness and the kfake broker it runs Kafka on (a child
# process), makes sure PostgreSQL, Redis, RabbitMQ and NATS are up (and MariaDB,
# for the sqltable row on it, when it can), and prints
# the table on stdout (progress on stderr). docs/BENCHMARKS.md holds the
# output of the latest full run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v pgbench >/dev/null || echo "bench: pgbench is not installed: the SQL floors will not be measured" >&2
scripts/services.sh up postgres redis rabbitmq nats >/dev/null
scripts/services.sh up mariadb >/dev/null || echo "bench: MariaDB is not reachable: the sqltable row on MariaDB will not be measured" >&2
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
go build -o "$bin/bench" ./test/bench/cmd/bench
go build -o "$bin/kfake" ./test/bench/cmd/kfake
"$bin/bench" -kfake "$bin/kfake" "$@"
