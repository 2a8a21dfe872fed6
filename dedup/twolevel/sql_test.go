package twolevel_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/dedup/twolevel"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// sqlFixture is a two-level store over sqltable on MariaDB.
type sqlFixture struct {
	db     *sqltable.Store
	prefix string
}

var sqlRegistry sync.Map // *twolevel.Store[*sql.Tx] -> *sqlFixture

// TestConformanceMariaDB: the conformance suite on Redis in front of the
// database/sql store on MariaDB: the two levels work over any
// transactional store that can look a key up.
func TestConformanceMariaDB(t *testing.T) {
	t.Parallel()
	mdb := testenv.MySQL(t, "")
	mdb.SetMaxOpenConns(40)
	rdb := testenv.Redis(t)
	deduptest.RunTx(t, deduptest.TxHarness[*sql.Tx]{
		New: func(t testing.TB) dedup.TxStore[*sql.Tx] {
			table := testenv.Name("tl")
			t.Cleanup(func() {
				_, _ = mdb.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+table+"`, `"+table+"_migrations`")
			})
			db, err := sqltable.New(mdb, sqltable.MySQL, sqltable.Options{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			if err := db.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			prefix := testenv.Name("idem2lsql")
			cache, err := redisnx.New(rdb, redisnx.Options{Prefix: prefix})
			if err != nil {
				t.Fatal(err)
			}
			s, err := twolevelNew(cache, db)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { flushPrefix(t, rdb, prefix) })
			sqlRegistry.Store(s, &sqlFixture{db: db, prefix: prefix})
			return s
		},
		Down: func(t testing.TB) dedup.TxStore[*sql.Tx] {
			deadRedis := redis.NewClient(&redis.Options{Addr: testenv.DeadAddr(t), MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
			t.Cleanup(func() { _ = deadRedis.Close() })
			cache, err := redisnx.New(deadRedis, redisnx.Options{})
			if err != nil {
				t.Fatal(err)
			}
			dead, err := sql.Open("mysql", "root@tcp("+testenv.DeadAddr(t)+")/test?timeout=2s")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = dead.Close() })
			db, err := sqltable.New(dead, sqltable.MySQL, sqltable.Options{})
			if err != nil {
				t.Fatal(err)
			}
			s, err := twolevelNew(cache, db)
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
		Expire: func(t testing.TB, s dedup.TxStore[*sql.Tx]) {
			v, _ := sqlRegistry.Load(s)
			f := v.(*sqlFixture)
			flushPrefix(t, rdb, f.prefix)
			if _, err := mdb.ExecContext(context.Background(), "UPDATE "+f.db.Table()+" SET expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND"); err != nil {
				t.Fatal(err)
			}
			if _, err := f.db.Cleanup(context.Background()); err != nil {
				t.Fatal(err)
			}
		},
	})
}

// twolevelNew is twolevel.New with the transaction type inferred from the
// database store.
func twolevelNew(cache dedup.LeaseStore, db *sqltable.Store) (dedup.TxStore[*sql.Tx], error) {
	return twolevel.New(cache, db, twolevel.Options{CacheTimeout: 10 * time.Second})
}
