// Package fault holds the server-side fault injectors of idem's reliability
// matrix (test/chaos) and of tests that need a server to misbehave:
//
//   - Postgres: a throwaway PostgreSQL cluster (initdb in a temporary
//     directory, fsync on) on a free port, that can be crashed with
//     `pg_ctl stop -m immediate` and started again on the same data
//     directory, where crash recovery replays the WAL.
//   - Redis: a throwaway redis-server without persistence (--save ""
//     --appendonly no) that can be SIGKILLed and restarted empty, and whose
//     client connections can be killed (CLIENT KILL).
//   - MariaDB: a throwaway mariadbd (mariadb-install-db in a temporary
//     directory, --no-defaults, its own port and socket) that can be
//     SIGKILLed and started again on the same data directory, where InnoDB
//     crash recovery keeps what committed.
//   - NATS: a throwaway nats-server with JetStream (-js, its own store
//     directory and port) that can be SIGKILLed and started again on the
//     same store, where JetStream recovers its streams and consumers.
//   - Proxy: a small TCP proxy whose mode is switched at run time: pass,
//     delay every chunk, reset the connections, or cut a connection after the
//     request was forwarded and before the reply reaches the client (the
//     ambiguous acknowledgement: the server did the work, the client cannot
//     know).
//   - Pause and Resume: SIGSTOP and SIGCONT of a child process, for a
//     handler frozen past its lease.
//
// Postgres, MariaDB, Redis, NATS, Pause and Resume need a Unix system (build tag unix);
// the Proxy runs anywhere.
//
// Every server and proxy has an owner that stops it: Close stops the process
// or the listener, waits for the goroutines it started and removes its
// temporary directory. The server processes are started with a parent-death
// signal (Linux), so they do not outlive a test binary that is killed.
//
// PostgreSQL refuses to run as root. When the caller is root, Postgres runs
// initdb and postgres as the "postgres" OS user (a credential on the child
// process) in a directory it owns; without such a user it fails with an
// error that says so. The binaries are found in PostgresOptions.BinDir,
// $IDEM_PG_BINDIR, `pg_config --bindir`, the newest
// /usr/lib/postgresql/*/bin or $PATH, in that order. MariaDB, run by root,
// runs as the "mysql" OS user the same way; its binaries are found in
// MariaDBOptions.BinDir, $IDEM_MARIADB_BINDIR, $PATH, /usr/sbin or /usr/bin.
package fault
