package relaycore

import (
	"encoding/hex"
	"hash/fnv"

	"github.com/google/uuid"
)

// The names and hashes of outbox/pgoutbox's table layout, which
// outbox/sqloutbox writes alike on PostgreSQL so that pgoutbox's relay
// wakes up on its rows and orders and shards them with its own.

// PGChannel is the LISTEN/NOTIFY channel of the outbox schema.table:
// "idem_outbox.<schema>.<table>", or a hash of the name when that is
// longer than 63 bytes.
func PGChannel(schema, table string) string {
	name := schema + "." + table
	ch := "idem_outbox." + name
	if len(ch) > 63 { // NAMEDATALEN - 1
		h := fnv.New64a()
		for _, p := range []string{"channel", name} {
			h.Write([]byte(p))
			h.Write([]byte{0})
		}
		ch = "idem_outbox." + hex.EncodeToString(h.Sum(nil))
	}
	return ch
}

// PGKeyLockNS is the advisory lock namespace of the keys of the outbox
// schema.table.
func PGKeyLockNS(schema, table string) int64 {
	h := fnv.New64a()
	h.Write([]byte("idem:outbox:key:" + schema + "." + table))
	return int64(h.Sum64())
}

// PGKeyLockID is the advisory lock id of key in namespace ns.
func PGKeyLockID(ns int64, key []byte) int64 {
	h := fnv.New64a()
	var b [8]byte
	for i := range b {
		b[i] = byte(ns >> (8 * i))
	}
	h.Write(b[:])
	h.Write(key)
	return int64(h.Sum64())
}

// PGKeyHash spreads keys over the poll relay's shards; it is stored with
// the row. A keyless message is spread by its id, since it has no order
// to keep.
func PGKeyHash(key []byte, id uuid.UUID) int32 {
	h := fnv.New32a()
	if len(key) == 0 {
		h.Write(id[:])
	} else {
		h.Write(key)
	}
	return int32(h.Sum32() & 0x7fffffff)
}
