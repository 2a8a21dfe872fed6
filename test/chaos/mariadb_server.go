//go:build unix

package chaos

// mariadb/ and proxy/ cells of sqltable on MariaDB, the twins of
// pg/immediate/pgtable and proxy/pgtable:
//
//   - mariadb/sigkill/sqltable: a throwaway MariaDB (internal/testkit/fault)
//     SIGKILLed and started again (InnoDB crash recovery;
//     innodb_flush_log_at_trx_commit=1) while consumers claim each message
//     in dedup/sqltable and write its effect in the same transaction, both
//     on the throwaway server: the effects table is on the server that
//     crashes and is read after recovery. A commit whose reply is lost is
//     retried by the broker and found as a duplicate.
//   - proxy/sqltable-mariadb: the same consumers on the shared MariaDB
//     through the TCP fault proxy (cut replies after the request was sent,
//     delays, resets). A COMMIT whose reply is cut has committed: the
//     redelivery finds the claim and is acknowledged as a duplicate.
//
// Promise of both: 0 duplicate effects, 0 acknowledged messages without an
// effect.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/fault"
)

func init() {
	Register(Cell{Name: "mariadb/sigkill/sqltable", Run: srvMariaDBSQLTable})
	Register(Cell{Name: "proxy/sqltable-mariadb", Run: srvProxySQLTable})
}

// srvMyHandler is the consumer of both cells: consumer.Transactional on a
// sqltable store in o's database, the effect in the claim's transaction.
func srvMyHandler(db *sql.DB, o *myOracle, name string, outcomes *srvCounts) (consumer.Handler, error) {
	store, err := sqltable.New(db, sqltable.MySQL, sqltable.Options{Schema: o.database, Logger: srvQuiet})
	if err != nil {
		return nil, err
	}
	return consumer.Transactional(store, consumer.TxOptions{Scope: "chaos/" + name, Telemetry: consumer.Telemetry{OnOutcome: outcomes.outcome}},
		func(ctx context.Context, tx *sql.Tx, m *consumer.Message) error {
			return o.record(ctx, tx, m.ID, "consumer")
		})
}

// srvMyFaults SIGKILLs and restarts m rounds times, with random gaps. It
// keeps in *slowest the longest restart (crash recovery included).
func srvMyFaults(m *fault.MariaDB, rounds int, r *rand.Rand, res *Result, slowest *time.Duration, env *Env) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		for i := range rounds {
			if !srvSleep(ctx, srvBetween(r, 300*time.Millisecond, 900*time.Millisecond)) {
				return nil
			}
			if err := m.Kill(); err != nil {
				return fmt.Errorf("round %d: %w", i+1, err)
			}
			res.Kills++
			srvSleep(ctx, srvBetween(r, 100*time.Millisecond, 500*time.Millisecond))
			// Start even when ctx ended: the cell reads the server after.
			begin := time.Now()
			if err := m.Start(context.WithoutCancel(ctx)); err != nil {
				return fmt.Errorf("round %d: %w", i+1, err)
			}
			*slowest = max(*slowest, time.Since(begin))
			res.Restarts++
		}
		env.Logf("%d SIGKILL rounds done", rounds)
		return nil
	}
}

func srvMariaDBSQLTable(ctx context.Context, env *Env) (res Result, err error) {
	const name = "mariadb/sigkill/sqltable"
	n := env.Pick(600, 4000)
	rounds := env.Pick(5, 25)
	m, err := fault.StartMariaDB(ctx, fault.MariaDBOptions{})
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, m.Close()) }()
	admin, err := myOpen(ctx, m.DSN(), 2)
	if err != nil {
		return res, err
	}
	defer func() { _ = admin.Close() }()
	// The effects table is on the crashed server, in the claim's
	// transaction: read after recovery. Close removes the whole server.
	o, err := newMyOracle(ctx, admin, name, env.Seed)
	if err != nil {
		return res, err
	}
	if err := myMigrate(ctx, admin, o.database); err != nil {
		return res, err
	}
	dsn, err := myDSN(m.DSN(), o.database)
	if err != nil {
		return res, err
	}
	db, err := myOpen(ctx, dsn, 6)
	if err != nil {
		return res, err
	}
	defer func() { _ = db.Close() }()
	var outcomes srvCounts
	h, err := srvMyHandler(db, o, name, &outcomes)
	if err != nil {
		return res, err
	}
	q := newSrvQueue(srvRand(env), 0.1, time.Second)
	// A restart takes a few seconds (InnoDB recovery): pace the feed over
	// the rounds.
	plan := time.Duration(rounds) * 4 * time.Second
	var slowest time.Duration
	rep, runErr := srvRun(ctx, env, q, srvIDs(n), plan, 4, srvChain(h), srvMyFaults(m, rounds, srvRand(env), &res, &slowest, env))
	res.Messages, res.Redeliveries = rep.released, rep.redeliveries
	if !m.Running() {
		if err := m.Start(context.WithoutCancel(ctx)); err != nil {
			return res, errors.Join(runErr, err)
		}
		res.Restarts++
	}
	if err := myCheck(context.WithoutCancel(ctx), o, rep.acked, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	res.Note = fmt.Sprintf("sqltable on a throwaway MariaDB, SIGKILLed (slowest restart %v); %d acked after a lost commit reply (found as duplicate); %s",
		slowest.Round(100*time.Millisecond), rep.firstDup, outcomes.String())
	return res, runErr
}

func srvProxySQLTable(ctx context.Context, env *Env) (res Result, err error) {
	const name = "proxy/sqltable-mariadb"
	n := env.Pick(800, 5000)
	rounds := env.Pick(15, 100)
	root, err := myDSN(mySharedDSN(), "")
	if err != nil {
		return res, err
	}
	admin, err := myOpen(ctx, root, 4)
	if err != nil {
		return res, err
	}
	defer func() { _ = admin.Close() }()
	o, err := newMyOracle(ctx, admin, name, env.Seed)
	if err != nil {
		return res, err
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		err = errors.Join(err, o.drop(dctx))
	}()
	// Migrate directly; the store under test goes through the proxy.
	if err := myMigrate(ctx, admin, o.database); err != nil {
		return res, err
	}
	cfg, err := mysql.ParseDSN(mySharedDSN())
	if err != nil {
		return res, err
	}
	px, err := fault.NewProxy(cfg.Addr)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, px.Close()) }()
	cfg.Addr, cfg.DBName, cfg.Timeout = px.Addr(), o.database, 3*time.Second
	proxied, err := myOpen(ctx, cfg.FormatDSN(), 6)
	if err != nil {
		return res, err
	}
	defer func() { _ = proxied.Close() }()
	var outcomes srvCounts
	h, err := srvMyHandler(proxied, o, name, &outcomes)
	if err != nil {
		return res, err
	}
	q := newSrvQueue(srvRand(env), 0.05, 500*time.Millisecond)
	var bursts srvCounts
	plan := time.Duration(rounds) * srvProxyCycle
	rep, runErr := srvRun(ctx, env, q, srvIDs(n), plan, 4, srvChain(h), srvProxyFaults(px, rounds, srvRand(env), &bursts, env))
	res.Messages, res.Redeliveries, res.Kills = rep.released, rep.redeliveries, srvProxyKills(px)
	if err := myCheck(context.WithoutCancel(ctx), o, rep.acked, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	res.Note = fmt.Sprintf("sqltable on MariaDB; %d acked after a lost commit reply (found as duplicate); %s; %s", rep.firstDup, srvProxyNote(px, &bursts), outcomes.String())
	return res, runErr
}
