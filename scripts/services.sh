#!/usr/bin/env bash
# services.sh: the services idem's integration tests talk to.
#
#   scripts/services.sh up     [SERVICE...]   make them reachable (what `make up` runs)
#   scripts/services.sh status [SERVICE...]   probe only; exit 1 if one is down
#   scripts/services.sh down                  stop what `up` started with docker compose
#
# SERVICE is postgres, redis, rabbitmq, mariadb or nats (the default set), or
# kafka (only through docker compose; the tests use kfake and need no broker).
#
# `up`, for each service:
#   1. if it answers on its address (TCP connect plus a readiness probe:
#      pg_isready, a Redis PING, an AMQP protocol handshake, the MySQL
#      server greeting, the NATS INFO line), it is used as is;
#   2. else, if a Docker engine runs, `docker compose up -d --wait` starts it
#      from docker-compose.yml;
#   3. else, on Debian as root, the missing Debian packages are installed
#      (postgresql, redis-server, rabbitmq-server, mariadb-server,
#      nats-server) and the servers started, bound to 127.0.0.1 (NATS with
#      JetStream on);
#   4. else it says which service is missing and what to do, and exits 1.
# `up` also installs, on Debian as root, the tools the chaos matrix's
# partition/ cells need when they are missing: nft (nftables) and ip
# (iproute2). Without them those cells are skipped (and fail under CI=true).
# With PostgreSQL or MariaDB up, the test database is created if it is
# missing; on a MariaDB this script installed, root@127.0.0.1 gets an empty
# password, as the tests connect.
#
# Tools: `up` also makes sure of the programs that tests start throwaway
# copies of themselves, never as a service: pgbouncer (the tests and chaos
# cells through PgBouncer, internal/testkit/pgbouncer). A missing one is
# installed on Debian as root (the knobs below apply), and a system service
# its package's scripts may have started is stopped and disabled. When it
# cannot be installed, `up` says so and fails only under CI=true (or
# IDEM_REQUIRE_SERVICES=1), where the tests that need it would fail; else
# they skip. `status` lists them.
#
# Addresses, the same variables the tests read (internal/testkit/testenv):
#   IDEM_TEST_POSTGRES_URL   postgres://postgres@127.0.0.1:5432/test?sslmode=disable
#   IDEM_TEST_REDIS_ADDR     127.0.0.1:6379
#   IDEM_TEST_AMQP_URL       amqp://guest:guest@127.0.0.1:5672/
#   IDEM_TEST_MYSQL_DSN      root@tcp(127.0.0.1:3306)/test (go-sql-driver/mysql form)
#   IDEM_TEST_NATS_URL       nats://127.0.0.1:4222
#   IDEM_TEST_KAFKA_BROKERS  localhost:9092 (first broker; only for SERVICE kafka)
# A service pointed anywhere but its default local port is only checked:
# nothing is installed or started for it.
#
# Knobs:
#   IDEM_SERVICES_TIMEOUT=120    seconds to wait for a service this script started
#   IDEM_SERVICES_NO_DOCKER=1    never use docker compose
#   IDEM_SERVICES_NO_INSTALL=1   never install packages or start system services
#   IDEM_SERVICES_DRY_RUN=1      print the commands that would change the machine
#                                instead of running them
#   IDEM_SERVICES_SIMULATE_DOWN="postgres redis"
#                                treat these services (or tools: pgbouncer)
#                                as missing (for testing this script; pair
#                                with DRY_RUN=1)

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
COMPOSE_FILE=$ROOT/docker-compose.yml
COMPOSE_PROJECT=idem
WAIT_TIMEOUT=${IDEM_SERVICES_TIMEOUT:-120}
DRY_RUN=${IDEM_SERVICES_DRY_RUN:-0}
NO_DOCKER=${IDEM_SERVICES_NO_DOCKER:-0}
NO_INSTALL=${IDEM_SERVICES_NO_INSTALL:-0}
SIMULATE_DOWN=" ${IDEM_SERVICES_SIMULATE_DOWN:-} "

DEFAULT_SERVICES=(postgres redis rabbitmq mariadb nats)

# ---------------------------------------------------------------- helpers

have() { command -v "$1" >/dev/null 2>&1; }

say() { printf '%s\n' "$*"; }

err() { printf '%s\n' "$*" >&2; }

# run CMD...: a command that changes the machine; only printed in a dry run.
run() {
	if [[ $DRY_RUN == 1 ]]; then
		printf 'dry run: would run:'
		printf ' %q' "$@"
		printf '\n'
		return 0
	fi
	"$@"
}

# tmo SECONDS CMD...: CMD with a time limit when coreutils' timeout exists.
tmo() {
	local secs=$1
	shift
	if have timeout; then
		timeout "$secs" "$@"
	else
		"$@"
	fi
}

is_root() { [[ $(id -u) == 0 ]]; }

# split_hostport HOSTPORT DEFAULT_PORT: sets SP_HOST and SP_PORT.
# Accepts host, host:port, [v6]:port and a bare IPv6 address.
split_hostport() {
	local hp=$1
	SP_PORT=$2
	if [[ $hp == \[* ]]; then
		SP_HOST=${hp#\[}
		SP_HOST=${SP_HOST%%\]*}
		local rest=${hp#*\]}
		if [[ $rest == :?* ]]; then SP_PORT=${rest#:}; fi
	elif [[ $hp == *:*:* ]]; then
		SP_HOST=$hp
	elif [[ $hp == *:* ]]; then
		SP_HOST=${hp%%:*}
		[[ -n ${hp##*:} ]] && SP_PORT=${hp##*:}
	else
		SP_HOST=$hp
	fi
	[[ -n $SP_HOST ]] || SP_HOST=localhost
}

# split_url URL DEFAULT_PORT: sets U_SCHEME U_AUTHORITY U_USERINFO U_HOST U_PORT
# U_PATH U_QUERY
# for scheme://[userinfo@]host[:port][/path][?query].
split_url() {
	local url=$1 rest authority
	U_SCHEME=${url%%://*}
	rest=${url#*://}
	authority=${rest%%[/?]*}
	U_AUTHORITY=$authority
	rest=${rest:${#authority}}
	U_QUERY=
	if [[ $rest == *\?* ]]; then
		U_QUERY=${rest#*\?}
		rest=${rest%%\?*}
	fi
	U_PATH=${rest#/}
	U_USERINFO=
	if [[ $authority == *@* ]]; then
		U_USERINFO=${authority%@*}
		authority=${authority##*@}
	fi
	split_hostport "$authority" "$2"
	U_HOST=$SP_HOST
	U_PORT=$SP_PORT
}

is_loopback() {
	case $1 in
	127.0.0.1 | localhost | ::1) return 0 ;;
	*) return 1 ;;
	esac
}

# --------------------------------------------------------- configuration

PG_DEFAULT_URL='postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
PG_URL=${IDEM_TEST_POSTGRES_URL:-$PG_DEFAULT_URL}
PG_FROM=${IDEM_TEST_POSTGRES_URL:+IDEM_TEST_POSTGRES_URL}
PG_USER=postgres
PG_DB=
PG_MAINT_URL=
if [[ $PG_URL == *://* ]]; then
	split_url "$PG_URL" 5432
	PG_HOST=$U_HOST PG_PORT=$U_PORT
	[[ -n $U_USERINFO ]] && PG_USER=${U_USERINFO%%:*}
	PG_DB=$U_PATH
	# The same URL on database "postgres", where CREATE DATABASE runs.
	PG_MAINT_URL="$U_SCHEME://$U_AUTHORITY/postgres${U_QUERY:+?$U_QUERY}"
else
	# key=value form: host=... port=... user=... dbname=...
	PG_HOST=localhost PG_PORT=5432
	for kv in $PG_URL; do
		case $kv in
		host=*) PG_HOST=${kv#host=} ;;
		port=*) PG_PORT=${kv#port=} ;;
		user=*) PG_USER=${kv#user=} ;;
		dbname=*) PG_DB=${kv#dbname=} ;;
		esac
	done
	PG_MAINT_URL="$PG_URL dbname=postgres"
fi
PG_DB=${PG_DB:-$PG_USER}

split_hostport "${IDEM_TEST_REDIS_ADDR:-127.0.0.1:6379}" 6379
REDIS_HOST=$SP_HOST REDIS_PORT=$SP_PORT
REDIS_FROM=${IDEM_TEST_REDIS_ADDR:+IDEM_TEST_REDIS_ADDR}

split_url "${IDEM_TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/}" 5672
AMQP_HOST=$U_HOST AMQP_PORT=$U_PORT
AMQP_FROM=${IDEM_TEST_AMQP_URL:+IDEM_TEST_AMQP_URL}

# go-sql-driver/mysql's DSN: [user[:password]@][tcp(host:port)]/dbname[?params]
MYSQL_DSN=${IDEM_TEST_MYSQL_DSN:-root@tcp(127.0.0.1:3306)/test}
MYSQL_FROM=${IDEM_TEST_MYSQL_DSN:+IDEM_TEST_MYSQL_DSN}
MYSQL_USER=root
[[ $MYSQL_DSN == *@* ]] && MYSQL_USER=${MYSQL_DSN%%@*} && MYSQL_USER=${MYSQL_USER%%:*}
MYSQL_ADDR=127.0.0.1:3306
if [[ $MYSQL_DSN == *'tcp('*')'* ]]; then
	MYSQL_ADDR=${MYSQL_DSN#*tcp(}
	MYSQL_ADDR=${MYSQL_ADDR%%)*}
fi
split_hostport "$MYSQL_ADDR" 3306
MYSQL_HOST=$SP_HOST MYSQL_PORT=$SP_PORT
MYSQL_DB=${MYSQL_DSN#*/}
MYSQL_DB=${MYSQL_DB%%\?*}

split_url "${IDEM_TEST_NATS_URL:-nats://127.0.0.1:4222}" 4222
NATS_HOST=$U_HOST NATS_PORT=$U_PORT
NATS_FROM=${IDEM_TEST_NATS_URL:+IDEM_TEST_NATS_URL}

split_hostport "${IDEM_TEST_KAFKA_BROKERS:-localhost:9092}" 9092
KAFKA_HOST=${SP_HOST%%,*} KAFKA_PORT=${SP_PORT%%,*}
KAFKA_FROM=${IDEM_TEST_KAFKA_BROKERS:+IDEM_TEST_KAFKA_BROKERS}

# svc_host / svc_port / svc_from / svc_default_port NAME
svc_host() {
	case $1 in
	postgres) say "$PG_HOST" ;; redis) say "$REDIS_HOST" ;;
	rabbitmq) say "$AMQP_HOST" ;; kafka) say "$KAFKA_HOST" ;;
	mariadb) say "$MYSQL_HOST" ;; nats) say "$NATS_HOST" ;;
	esac
}
svc_port() {
	case $1 in
	postgres) say "$PG_PORT" ;; redis) say "$REDIS_PORT" ;;
	rabbitmq) say "$AMQP_PORT" ;; kafka) say "$KAFKA_PORT" ;;
	mariadb) say "$MYSQL_PORT" ;; nats) say "$NATS_PORT" ;;
	esac
}
svc_from() {
	case $1 in
	postgres) say "$PG_FROM" ;; redis) say "$REDIS_FROM" ;;
	rabbitmq) say "$AMQP_FROM" ;; kafka) say "$KAFKA_FROM" ;;
	mariadb) say "$MYSQL_FROM" ;; nats) say "$NATS_FROM" ;;
	esac
}
svc_default_port() {
	case $1 in
	postgres) say 5432 ;; redis) say 6379 ;; rabbitmq) say 5672 ;; kafka) say 9092 ;;
	mariadb) say 3306 ;; nats) say 4222 ;;
	esac
}
svc_addr() {
	local h
	h=$(svc_host "$1")
	[[ $h == *:* ]] && h="[$h]"
	say "$h:$(svc_port "$1")"
}
svc_package() {
	case $1 in
	postgres) say postgresql ;; redis) say redis-server ;; rabbitmq) say rabbitmq-server ;;
	mariadb) say mariadb-server ;; nats) say nats-server ;;
	esac
}
svc_env_var() {
	case $1 in
	postgres) say IDEM_TEST_POSTGRES_URL ;; redis) say IDEM_TEST_REDIS_ADDR ;;
	rabbitmq) say IDEM_TEST_AMQP_URL ;; kafka) say IDEM_TEST_KAFKA_BROKERS ;;
	mariadb) say IDEM_TEST_MYSQL_DSN ;; nats) say IDEM_TEST_NATS_URL ;;
	esac
}

# managed NAME: the service is at its default local address, so this
# script may start it. Anywhere else it is only checked.
managed() {
	is_loopback "$(svc_host "$1")" && [[ $(svc_port "$1") == "$(svc_default_port "$1")" ]]
}

# ---------------------------------------------------------------- probes

tcp_open() {
	# shellcheck disable=SC2016 # $0 and $1 expand in the inner shell
	tmo 5 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null
}

probe_postgres() {
	tcp_open "$PG_HOST" "$PG_PORT" || return 1
	if have pg_isready; then
		tmo 10 pg_isready -q -h "$PG_HOST" -p "$PG_PORT" -t 5 || return 1
	fi
}

probe_redis() {
	tcp_open "$REDIS_HOST" "$REDIS_PORT" || return 1
	local reply
	if have redis-cli; then
		reply=$(tmo 5 redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null) || return 1
		[[ $reply == PONG ]]
	else
		# shellcheck disable=SC2016 # $0 and $1 expand in the inner shell
		tmo 5 bash -c 'exec 3<>"/dev/tcp/$0/$1" && printf "PING\r\n" >&3 &&
			IFS= read -r line <&3 && [[ $line == "+PONG"* ]]' "$REDIS_HOST" "$REDIS_PORT" 2>/dev/null
	fi
}

# An AMQP 0-9-1 handshake: a ready broker answers the protocol header with a
# method frame (type 1, Connection.Start). This works for a broker in a
# container too, where rabbitmq-diagnostics could not reach the node.
probe_rabbitmq() {
	tcp_open "$AMQP_HOST" "$AMQP_PORT" || return 1
	local reply
	# shellcheck disable=SC2016 # $0 and $1 expand in the inner shell
	reply=$(tmo 10 bash -c 'exec 3<>"/dev/tcp/$0/$1" && printf "AMQP\000\000\011\001" >&3 &&
		head -c 1 <&3 | od -An -tx1' "$AMQP_HOST" "$AMQP_PORT" 2>/dev/null) || return 1
	[[ ${reply//[[:space:]]/} == 01 ]]
}

# The MySQL protocol: the server speaks first, a packet whose fifth byte is
# the protocol version, 10 (0x0a). A server that refuses the host answers
# an error packet (0xff) instead.
probe_mariadb() {
	tcp_open "$MYSQL_HOST" "$MYSQL_PORT" || return 1
	local reply
	# shellcheck disable=SC2016 # $0 and $1 expand in the inner shell
	reply=$(tmo 10 bash -c 'exec 3<>"/dev/tcp/$0/$1" && head -c 5 <&3 | od -An -tx1' \
		"$MYSQL_HOST" "$MYSQL_PORT" 2>/dev/null) || return 1
	reply=${reply//[[:space:]]/}
	[[ ${reply:8:2} == 0a ]]
}

# NATS: the server greets every connection with an INFO line; JetStream is
# on when it says "jetstream":true.
probe_nats() {
	tcp_open "$NATS_HOST" "$NATS_PORT" || return 1
	local line
	# shellcheck disable=SC2016 # $0 and $1 expand in the inner shell
	line=$(tmo 5 bash -c 'exec 3<>"/dev/tcp/$0/$1" && IFS= read -r line <&3 && printf "%s" "$line"' \
		"$NATS_HOST" "$NATS_PORT" 2>/dev/null) || return 1
	[[ $line == INFO* && $line == *'"jetstream":true'* ]]
}

probe_kafka() {
	tcp_open "$KAFKA_HOST" "$KAFKA_PORT"
}

probe() {
	[[ $SIMULATE_DOWN == *" $1 "* ]] && return 1
	"probe_$1"
}

# wait_ready NAME SECONDS
wait_ready() {
	local deadline=$((SECONDS + $2))
	until probe "$1"; do
		if ((SECONDS >= deadline)); then
			return 1
		fi
		sleep 1
	done
}

# ------------------------------------------------------ test database

pg_create_db() {
	local sql="CREATE DATABASE \"${PG_DB//\"/\"\"}\""
	if have psql && run env PGCONNECT_TIMEOUT=5 psql "$PG_MAINT_URL" -Xq -v ON_ERROR_STOP=1 -c "$sql"; then
		return 0
	fi
	if is_root && is_loopback "$PG_HOST" && have runuser && have psql && id postgres >/dev/null 2>&1 &&
		run runuser -u postgres -- psql -p "$PG_PORT" -Xq -v ON_ERROR_STOP=1 -c "$sql"; then
		return 0
	fi
	if docker_usable && [[ -n $("${COMPOSE[@]}" ps -q postgres 2>/dev/null) ]] &&
		run "${COMPOSE[@]}" exec -T postgres psql -U postgres -Xq -v ON_ERROR_STOP=1 -c "$sql"; then
		return 0
	fi
	return 1
}

# ensure_pg_db: connect as the tests do; create the database if it is the
# only thing missing. Prints a problem and returns 1 otherwise.
ensure_pg_db() {
	if ! have psql; then
		return 0 # nothing to check with; the tests will say
	fi
	local out
	if out=$(PGCONNECT_TIMEOUT=5 psql "$PG_URL" -Xqt -c 'SELECT 1' 2>&1 >/dev/null); then
		return 0
	fi
	if [[ $out == *"database \"$PG_DB\" does not exist"* ]]; then
		if ! managed postgres; then
			err "postgres: $(svc_addr postgres) answers but has no database \"$PG_DB\"; create it there (CREATE DATABASE \"$PG_DB\")"
			return 1
		fi
		if pg_create_db; then
			if [[ $DRY_RUN == 1 ]]; then
				say "postgres: would create database \"$PG_DB\" (dry run)"
			else
				say "postgres: created database \"$PG_DB\""
			fi
			return 0
		fi
		err "postgres: could not create database \"$PG_DB\" on $(svc_addr postgres); create it by hand: psql -h $PG_HOST -p $PG_PORT -U postgres -c 'CREATE DATABASE \"$PG_DB\"'"
		return 1
	fi
	err "postgres: $(svc_addr postgres) answers, but connecting with ${PG_FROM:-the default URL} ($PG_URL) fails:"
	err "  ${out//$'\n'/$'\n'  }"
	err "  the tests connect as user \"$PG_USER\" without a password unless the URL has one: allow it in pg_hba.conf (trust for 127.0.0.1/32), or set IDEM_TEST_POSTGRES_URL"
	return 1
}

# ensure_mysql_db: connect as the tests do (when the mariadb client is
# here) and create the test database if it is the only thing missing.
ensure_mysql_db() {
	local client
	client=$(command -v mariadb || command -v mysql || true)
	[[ -n $client ]] || return 0 # nothing to check with; the tests will say
	local pw=() out
	if [[ $MYSQL_DSN == *:*@* ]]; then
		local up=${MYSQL_DSN%%@*}
		pw=("--password=${up#*:}")
	fi
	if out=$(tmo 10 "$client" -h "$MYSQL_HOST" -P "$MYSQL_PORT" -u "$MYSQL_USER" ${pw[@]+"${pw[@]}"} \
		-e "CREATE DATABASE IF NOT EXISTS \`${MYSQL_DB//\`/\`\`}\`" 2>&1); then
		return 0
	fi
	err "mariadb: $(svc_addr mariadb) answers, but the tests' login (${MYSQL_FROM:-the default DSN} $MYSQL_DSN) fails:"
	err "  ${out//$'\n'/$'\n'  }"
	err "  the tests connect as $MYSQL_USER from 127.0.0.1 without a password unless the DSN has one:"
	err "    mariadb -e \"CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY ''; GRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION\""
	err "  or set IDEM_TEST_MYSQL_DSN"
	return 1
}

# ------------------------------------------------------- docker compose

COMPOSE=()
DOCKER_CHECKED=0
DOCKER_OK=1

docker_usable() {
	if ((DOCKER_CHECKED)); then
		return "$DOCKER_OK"
	fi
	DOCKER_CHECKED=1
	[[ $NO_DOCKER == 1 ]] && return 1
	have docker || return 1
	tmo 20 docker info >/dev/null 2>&1 || return 1
	if docker compose version >/dev/null 2>&1; then
		COMPOSE=(docker compose)
	elif have docker-compose && [[ $(docker-compose version --short 2>/dev/null) == [2-9]* ]]; then
		COMPOSE=(docker-compose)
	else
		err "services.sh: a Docker engine runs but Docker Compose v2 is missing (the docker-compose-plugin package)"
		return 1
	fi
	COMPOSE+=(-f "$COMPOSE_FILE" -p "$COMPOSE_PROJECT")
	DOCKER_OK=0
}

# --------------------------------------------------- Debian packages

APT_UPDATED=0
INSTALLED_NOW=" "

can_install() {
	[[ $NO_INSTALL != 1 ]] && [[ -r /etc/debian_version ]] && is_root && have apt-get && have dpkg-query
}

pkg_installed() {
	[[ $(dpkg-query -W -f='${Status}' "$1" 2>/dev/null) == "install ok installed" ]]
}

# install_packages NAME...: install the Debian packages of the services
# that are not installed yet.
install_packages() {
	local pkgs=() s p
	for s in "$@"; do
		p=$(svc_package "$s")
		if ! pkg_installed "$p"; then
			pkgs+=("$p")
			INSTALLED_NOW+="$s "
		fi
	done
	((${#pkgs[@]})) || return 0
	say "installing ${pkgs[*]} with apt-get"
	if ((!APT_UPDATED)); then
		run env DEBIAN_FRONTEND=noninteractive apt-get update -q
		APT_UPDATED=1
	fi
	run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}"
}

# ensure_net_tools: install nftables and iproute2 when nft or ip is missing
# (see the header); a failure is reported, not fatal.
ensure_net_tools() {
	local pkgs=()
	have nft || pkgs+=(nftables)
	have ip || pkgs+=(iproute2)
	((${#pkgs[@]})) || return 0
	if ! can_install; then
		err "services.sh: ${pkgs[*]} missing: the chaos matrix's partition/ cells need them (Debian packages ${pkgs[*]})"
		return 0
	fi
	say "installing ${pkgs[*]} with apt-get (for the chaos matrix's partition/ cells)"
	if ((!APT_UPDATED)); then
		run env DEBIAN_FRONTEND=noninteractive apt-get update -q || true
		APT_UPDATED=1
	fi
	run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" ||
		err "services.sh: installing ${pkgs[*]} failed: the partition/ cells will be skipped (or fail under CI=true)"
}

# ensure_browser: install Chromium when it is missing: the console's
# browser tests (cmd/idem, TestConsole*) drive it headless, and fail
# under CI=true without it.
ensure_browser() {
	[[ -x /usr/bin/chromium ]] && return 0
	if ! can_install; then
		err "services.sh: chromium missing: the console's browser tests need it (Debian packages chromium chromium-driver)"
		return 0
	fi
	say "installing chromium with apt-get (for the console's browser tests)"
	if ((!APT_UPDATED)); then
		run env DEBIAN_FRONTEND=noninteractive apt-get update -q || true
		APT_UPDATED=1
	fi
	run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver ||
		err "services.sh: installing chromium failed: the console's browser tests will be skipped (or fail under CI=true)"
}

# ------------------------------------------------------------------ tools

TOOLS=(pgbouncer)

# tool_path NAME: prints the tool's executable; fails when it is missing.
# Debian installs pgbouncer in /usr/sbin, which a user's PATH may lack.
tool_path() {
	[[ $SIMULATE_DOWN == *" $1 "* ]] && return 1
	local p
	if [[ $1 == pgbouncer && -n ${IDEM_PGBOUNCER:-} && -x $IDEM_PGBOUNCER ]]; then
		say "$IDEM_PGBOUNCER"
		return 0
	fi
	if p=$(command -v "$1" 2>/dev/null); then
		say "$p"
		return 0
	fi
	for p in "/usr/sbin/$1" "/usr/local/sbin/$1" "/usr/local/bin/$1"; do
		if [[ -x $p ]]; then
			say "$p"
			return 0
		fi
	done
	return 1
}

# stop_tool_service NAME: the tests start their own copies; stop and
# disable the system service the package's scripts may have started.
stop_tool_service() {
	if [[ -d /run/systemd/system ]] && have systemctl; then
		run systemctl disable --now "$1.service" "$1.socket" 2>/dev/null || true
	elif [[ -x /etc/init.d/$1 ]]; then
		run /etc/init.d/"$1" stop 2>/dev/null || true
		if have update-rc.d; then
			run update-rc.d "$1" disable 2>/dev/null || true
		fi
	fi
}

# ensure_tools: install the missing tools where this script may; returns 1
# when one is still missing and CI=true or IDEM_REQUIRE_SERVICES=1.
ensure_tools() {
	local t missing=()
	for t in "${TOOLS[@]}"; do
		tool_path "$t" >/dev/null || missing+=("$t")
	done
	((${#missing[@]})) || return 0
	if can_install; then
		say "installing ${missing[*]} with apt-get (tools the tests start themselves)"
		if ((!APT_UPDATED)); then
			run env DEBIAN_FRONTEND=noninteractive apt-get update -q
			APT_UPDATED=1
		fi
		if run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; then
			for t in "${missing[@]}"; do
				stop_tool_service "$t"
				if [[ $DRY_RUN == 1 ]]; then
					say "$t: would be installed (dry run)"
				else
					say "$t: installed ($(tool_path "$t" || echo "not found after the install"))"
				fi
			done
			return 0
		fi
	fi
	for t in "${missing[@]}"; do
		err "$t: MISSING - the tests that run it skip, or fail under CI=true"
		err "  install it: apt-get install $t (Debian), or set IDEM_PGBOUNCER to the pgbouncer executable"
	done
	if [[ ${CI:-} == true || ${IDEM_REQUIRE_SERVICES:-} == 1 ]]; then
		return 1
	fi
	return 0
}

tools_status() {
	local t p
	for t in "${TOOLS[@]}"; do
		if p=$(tool_path "$t"); then
			say "$t: installed ($p)"
		else
			say "$t: missing (tool; the tests that run it skip, or fail under CI=true)"
		fi
	done
}

# start_NAME: returns 0 when started, 1 when the start command failed, 2 when
# the service cannot be started here at all.
start_postgres() {
	have pg_ctlcluster || {
		err "postgres: pg_ctlcluster not found (postgresql-common)"
		return 2
	}
	local ver fresh=0 dir
	ver=$(find /etc/postgresql -mindepth 1 -maxdepth 1 -type d -printf '%f\n' 2>/dev/null | sort -V | tail -n 1)
	if [[ -z $ver || ! -d /etc/postgresql/$ver/main ]]; then
		ver=${ver:-$(find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -type d -printf '%f\n' 2>/dev/null | sort -V | tail -n 1)}
		if [[ -z $ver ]]; then
			err "postgres: no PostgreSQL server installed under /usr/lib/postgresql"
			return 2
		fi
		run pg_createcluster "$ver" main
		fresh=1
	fi
	[[ $INSTALLED_NOW == *" postgres "* ]] && fresh=1
	dir=/etc/postgresql/$ver/main
	if ((fresh)); then
		# A fresh cluster: listen on 127.0.0.1:5432 only, trust local TCP
		# connections (a test database, never a production one).
		if ! grep -Eqs '^[[:space:]]*listen_addresses' "$dir/conf.d"/*.conf; then
			if [[ $DRY_RUN == 1 ]]; then
				say "dry run: would write $dir/conf.d/90-idem.conf (listen_addresses = '127.0.0.1', port = 5432)"
			else
				mkdir -p "$dir/conf.d"
				printf "listen_addresses = '127.0.0.1'\nport = 5432\n" >"$dir/conf.d/90-idem.conf"
			fi
		fi
		if ! grep -Eqs '^host[[:space:]]+all[[:space:]]+all[[:space:]]+127\.0\.0\.1/32[[:space:]]+trust' "$dir/pg_hba.conf"; then
			run sed -i '1i host all all 127.0.0.1/32 trust' "$dir/pg_hba.conf"
		fi
	fi
	if [[ $DRY_RUN != 1 ]] && pg_ctlcluster "$ver" main status >/dev/null 2>&1; then
		# Already running (a package's scripts may start it): pick up the
		# pg_hba.conf change; 'localhost' already listens on 127.0.0.1.
		run pg_ctlcluster --skip-systemctl-redirect "$ver" main reload || return 1
		return 0
	fi
	run pg_ctlcluster --skip-systemctl-redirect "$ver" main start || return 1
}

start_redis() {
	have redis-server || {
		err "redis: redis-server not found"
		return 2
	}
	run mkdir -p /var/lib/redis /var/log/redis
	run redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
		--dir /var/lib/redis --logfile /var/log/redis/ci.log || return 1
}

start_rabbitmq() {
	have rabbitmq-server || {
		err "rabbitmq: rabbitmq-server not found"
		return 2
	}
	if [[ $INSTALLED_NOW == *" rabbitmq "* ]]; then
		# A fresh install: a node name that resolves without DNS, and every
		# listener on loopback.
		if [[ $DRY_RUN == 1 ]]; then
			say "dry run: would write /etc/rabbitmq/rabbitmq-env.conf and rabbitmq.conf (node rabbit@localhost, listeners on 127.0.0.1)"
		else
			mkdir -p /etc/rabbitmq
			grep -qs '^NODENAME=' /etc/rabbitmq/rabbitmq-env.conf ||
				printf 'NODENAME=rabbit@localhost\nERL_EPMD_ADDRESS=127.0.0.1\nexport ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"\n' \
					>>/etc/rabbitmq/rabbitmq-env.conf
			grep -qs '^listeners\.tcp' /etc/rabbitmq/rabbitmq.conf ||
				printf 'listeners.tcp.local = 127.0.0.1:5672\n' >>/etc/rabbitmq/rabbitmq.conf
		fi
	fi
	run rabbitmq-server -detached || return 1
}

start_mariadb() {
	[[ -x /usr/sbin/mariadbd ]] || {
		err "mariadb: /usr/sbin/mariadbd not found"
		return 2
	}
	run mkdir -p /run/mysqld
	run chown mysql:mysql /run/mysqld
	if [[ $INSTALLED_NOW == *" mariadb "* ]]; then
		if [[ $DRY_RUN == 1 ]]; then
			say "dry run: would write /etc/mysql/mariadb.conf.d/90-idem.cnf (bind-address = 127.0.0.1)"
		else
			mkdir -p /etc/mysql/mariadb.conf.d
			printf '[mariadbd]\nbind-address = 127.0.0.1\nport = 3306\n' >/etc/mysql/mariadb.conf.d/90-idem.cnf
		fi
	fi
	run start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || return 1
	if [[ $INSTALLED_NOW == *" mariadb "* && $DRY_RUN != 1 ]]; then
		# A fresh install: root over TCP from 127.0.0.1 without a password,
		# as the tests connect (a test server, never a production one).
		wait_ready mariadb "$WAIT_TIMEOUT" || return 1
		mariadb -e "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY ''; GRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION" || return 1
	fi
}

start_nats() {
	have nats-server || {
		err "nats: nats-server not found"
		return 2
	}
	run mkdir -p /var/lib/nats-server /var/log
	run start-stop-daemon --start --oknodo --background --exec "$(command -v nats-server)" -- \
		-a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log || return 1
}

# -------------------------------------------------------------- commands

# missing_help NAME REASON: what the user must do.
missing_help() {
	local s=$1 why=$2 var
	var=$(svc_env_var "$s")
	err "$s: MISSING at $(svc_addr "$s") - $why"
	case $s in
	postgres)
		err "  start PostgreSQL on 127.0.0.1:5432 with trust auth for 127.0.0.1/32 and a database \"$PG_DB\":"
		err "    docker compose up -d --wait postgres            (with a Docker engine)"
		err "    apt-get install postgresql && pg_ctlcluster --skip-systemctl-redirect \$(ls /etc/postgresql) main start   (Debian, as root)"
		;;
	redis)
		err "  start Redis on 127.0.0.1:6379:"
		err "    docker compose up -d --wait redis"
		err "    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save '' --appendonly no"
		;;
	rabbitmq)
		err "  start RabbitMQ on 127.0.0.1:5672 with the guest/guest user:"
		err "    docker compose up -d --wait rabbitmq"
		err "    apt-get install rabbitmq-server && rabbitmq-server -detached   (Debian, as root)"
		;;
	mariadb)
		err "  start MariaDB (10.6 or later) or MySQL 8 on 127.0.0.1:3306 with root from 127.0.0.1 without a password and a database \"$MYSQL_DB\":"
		err "    docker compose up -d --wait mariadb"
		err "    apt-get install mariadb-server && start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd   (Debian, as root)"
		;;
	nats)
		err "  start nats-server with JetStream on 127.0.0.1:4222:"
		err "    docker compose up -d --wait nats"
		err "    apt-get install nats-server && nats-server -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server &   (Debian)"
		;;
	kafka)
		err "  start a Kafka broker on localhost:9092: docker compose up -d --wait kafka"
		err "  (the tests run Kafka in process through kfake and need no broker)"
		;;
	esac
	err "  or point $var at a running one; then run: make up"
}

cmd_status() {
	local s bad=0 from
	for s in "$@"; do
		from=$(svc_from "$s")
		if probe "$s" && { [[ $s != postgres ]] || ensure_pg_db_readonly; }; then
			say "$s: up ($(svc_addr "$s")${from:+, from $from})"
		else
			say "$s: DOWN ($(svc_addr "$s")${from:+, from $from})"
			bad=1
		fi
	done
	return "$bad"
}

ensure_pg_db_readonly() {
	have psql || return 0
	PGCONNECT_TIMEOUT=5 psql "$PG_URL" -Xqt -c 'SELECT 1' >/dev/null 2>&1
}

cmd_up() {
	local s from failed=() todo=() started=()
	ensure_net_tools
	ensure_browser
	for s in "$@"; do
		from=$(svc_from "$s")
		if probe "$s"; then
			if [[ $s == postgres ]] && ! ensure_pg_db; then
				failed+=("$s")
				continue
			fi
			if [[ $s == mariadb ]] && ! ensure_mysql_db; then
				failed+=("$s")
				continue
			fi
			if managed "$s" && [[ -z $from ]]; then
				say "$s: up (already running)"
			else
				say "$s: up (already running at $(svc_addr "$s")${from:+, from $from})"
			fi
		elif managed "$s"; then
			todo+=("$s")
		else
			missing_help "$s" "nothing answers there (set by $from; services elsewhere are only checked, never started)"
			failed+=("$s")
		fi
	done

	if ((${#todo[@]})); then
		local how=
		if docker_usable; then
			how=docker
		elif can_install; then
			how=debian
		fi
		local sys=()
		for s in "${todo[@]}"; do
			if [[ $how == debian && $s == kafka ]]; then
				missing_help kafka "nothing answers there, and Kafka is only started through docker compose (no Docker engine runs)"
				failed+=(kafka)
			elif [[ -z $how ]]; then
				local why="nothing answers there"
				if [[ $NO_DOCKER == 1 ]]; then
					why+=", docker compose is off (IDEM_SERVICES_NO_DOCKER=1)"
				else
					why+=", no Docker engine runs (docker info fails)"
				fi
				if [[ $NO_INSTALL == 1 ]]; then
					why+=", installing is off (IDEM_SERVICES_NO_INSTALL=1)"
				else
					why+=", and it cannot be installed here (that needs Debian and root)"
				fi
				missing_help "$s" "$why"
				failed+=("$s")
			else
				sys+=("$s")
			fi
		done

		if ((${#sys[@]})) && [[ $how == docker ]]; then
			say "starting ${sys[*]} with docker compose"
			local up=("${COMPOSE[@]}" up -d --wait "${sys[@]}")
			have timeout && up=(timeout $((WAIT_TIMEOUT + 120)) "${up[@]}")
			if run "${up[@]}"; then
				started=("${sys[@]}")
			else
				for s in "${sys[@]}"; do missing_help "$s" "docker compose up failed"; done
				failed+=("${sys[@]}")
			fi
		elif ((${#sys[@]})); then
			if ! install_packages "${sys[@]}"; then
				for s in "${sys[@]}"; do missing_help "$s" "apt-get install failed"; done
				failed+=("${sys[@]}")
			else
				for s in "${sys[@]}"; do
					# A package's own scripts may have started it already
					# (PostgreSQL is configured all the same, then reloaded).
					local rc=0
					if [[ $DRY_RUN != 1 && $s != postgres ]] && probe "$s"; then
						started+=("$s")
						continue
					fi
					"start_$s" || rc=$?
					if ((rc == 0)); then
						started+=("$s")
					elif ((rc == 1)); then
						# It may be starting already (the start command refuses
						# a second server): wait for it all the same.
						err "$s: the start command failed; waiting in case it is already starting"
						started+=("$s")
					else
						missing_help "$s" "it cannot be started here"
						failed+=("$s")
					fi
				done
			fi
		fi

		for s in ${started[@]+"${started[@]}"}; do
			if [[ $DRY_RUN == 1 ]]; then
				say "$s: would be started ($how, dry run)"
				continue
			fi
			if ! wait_ready "$s" "$WAIT_TIMEOUT"; then
				missing_help "$s" "started, but not ready after ${WAIT_TIMEOUT}s (IDEM_SERVICES_TIMEOUT)"
				case $s in
				postgres) err "  log: /var/log/postgresql/" ;;
				redis) err "  log: /var/log/redis/ci.log" ;;
				rabbitmq) err "  log: /var/log/rabbitmq/" ;;
				mariadb) err "  log: journalctl, or the error log under /var/lib/mysql/" ;;
				nats) err "  log: /var/log/nats-server.log" ;;
				esac
				failed+=("$s")
				continue
			fi
			if [[ $s == postgres ]] && ! ensure_pg_db; then
				failed+=("$s")
				continue
			fi
			if [[ $s == mariadb ]] && ! ensure_mysql_db; then
				failed+=("$s")
				continue
			fi
			say "$s: up (started, $how)"
		done
	fi

	ensure_tools || failed+=("${TOOLS[@]}")

	if ((${#failed[@]})); then
		err "services.sh: not available: ${failed[*]}"
		return 1
	fi
}

cmd_down() {
	if ! docker_usable; then
		say "nothing to stop: no Docker engine, so nothing was started with docker compose (system services are left running)"
		return 0
	fi
	if [[ -z $("${COMPOSE[@]}" ps -q 2>/dev/null) ]]; then
		say "nothing to stop: no docker compose service of project $COMPOSE_PROJECT runs (system services are left running)"
		return 0
	fi
	run "${COMPOSE[@]}" down --volumes --remove-orphans
}

usage() {
	err "usage: $0 up|status|down [postgres|redis|rabbitmq|mariadb|nats|kafka ...]"
	exit 2
}

main() {
	local cmd=${1:-}
	[[ -n $cmd ]] || usage
	shift
	local s
	for s in "$@"; do
		case $s in
		postgres | redis | rabbitmq | mariadb | nats | kafka) ;;
		*)
			err "services.sh: unknown service $s"
			usage
			;;
		esac
	done
	(($#)) || set -- "${DEFAULT_SERVICES[@]}"
	case $cmd in
	up) cmd_up "$@" ;;
	status)
		tools_status
		cmd_status "$@"
		;;
	down) cmd_down ;;
	-h | --help | help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0" ;;
	*) usage ;;
	esac
}

main "$@"
