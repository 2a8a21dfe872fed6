package sqltable_test

import (
	"database/sql"
	"testing"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/pgbouncer"
)

// pgBouncerBackends are the PostgreSQL drivers through a PgBouncer of the
// test's own in transaction mode, each configured to send a statement and
// its parameters in one round trip: pgx's stdlib driver in the
// cache_describe exec mode, lib/pq with binary_parameters=yes (without it,
// lib/pq prepares an unnamed statement in one round trip and binds it in
// the next, which PgBouncer may send to another server connection).
var pgBouncerBackends = []backend{
	{name: "postgres-pgx", dialect: sqltable.Postgres, down: pgDown("pgx"), past: "clock_timestamp() - interval '1 second'",
		open: func(t testing.TB) *sql.DB {
			db := openDB(t, "pgx", pgbouncer.New(t, pgbouncer.Options{}).URL())
			db.SetMaxOpenConns(40)
			return db
		}},
	{name: "postgres-pq", dialect: sqltable.Postgres, down: pgDown("postgres"), past: "clock_timestamp() - interval '1 second'",
		open: func(t testing.TB) *sql.DB {
			db := openDB(t, "postgres", pgbouncer.New(t, pgbouncer.Options{}).URLMode("")+"&binary_parameters=yes")
			db.SetMaxOpenConns(40)
			return db
		}},
}

func TestPgBouncerConformanceTx(t *testing.T) {
	for _, b := range pgBouncerBackends {
		t.Run(b.name, func(t *testing.T) {
			db := b.open(t)
			deduptest.RunTx(t, deduptest.TxHarness[*sql.Tx]{
				New:    func(t testing.TB) dedup.TxStore[*sql.Tx] { return newStore(t, b, db, sqltable.Options{}) },
				Down:   func(t testing.TB) dedup.TxStore[*sql.Tx] { return downStore(t, b) },
				Expire: func(t testing.TB, s dedup.TxStore[*sql.Tx]) { expireAll(t, b, db, s.(*sqltable.Store)) },
			})
		})
	}
}

func TestPgBouncerConformanceLease(t *testing.T) {
	for _, b := range pgBouncerBackends {
		t.Run(b.name, func(t *testing.T) {
			db := b.open(t)
			deduptest.RunLease(t, deduptest.LeaseHarness{
				New: func(t testing.TB, cfg deduptest.Config) deduptest.LeaseInstance {
					s := newStore(t, b, db, sqltable.Options{Lease: cfg.Lease, Retention: cfg.TTL})
					return deduptest.LeaseInstance{Store: s.Lease()}
				},
				Down: func(t testing.TB) dedup.LeaseStore { return downStore(t, b).Lease() },
			})
		})
	}
}
