package dedup

import "time"

// Clock tells the time. Stores that keep time themselves (memstore) take one
// so tests can move time by hand; stores backed by a server use the server's
// clock instead. Where a Clock is optional, the default is the wall clock
// (time.Now).
type Clock interface {
	Now() time.Time
}
