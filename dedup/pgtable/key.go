package pgtable

import (
	"crypto/sha256"
	"encoding/binary"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/dedup"
)

// keyDigest is the primary key of a key's row: the first 16 bytes of
// SHA-256(scope || 0x00 || id), as a uuid (fixed size, no length header).
// dedup.Key.Hash shows the first 8 bytes of the same digest, so a row can
// be matched to a log line. keySQL computes it in SQL.
func keyDigest(scope, id string) pgtype.UUID {
	h := sha256.New()
	h.Write([]byte(scope))
	h.Write([]byte{0})
	h.Write([]byte(id))
	var sum [sha256.Size]byte
	d := pgtype.UUID{Valid: true}
	copy(d.Bytes[:], h.Sum(sum[:0]))
	return d
}

// keySQL is the SQL expression of keyDigest over the text expressions scope
// and id.
func keySQL(scope, id string) string {
	return "encode(substring(sha256(convert_to(" + scope + ", 'UTF8') || decode('00', 'hex') || convert_to(" + id +
		", 'UTF8')) FROM 1 FOR 16), 'hex')::uuid"
}

// keyLock is the advisory lock key of a key's digest in the table of seed
// (lockSeed): the digest's first 8 bytes, XORed with the seed so that the
// same key in two tables takes two locks.
func keyLock(d pgtype.UUID, seed int64) int64 {
	return int64(binary.BigEndian.Uint64(d.Bytes[:8])) ^ seed
}

// keyArgs is what a statement needs of a key: its digest, its lock and, with
// Options.KeepKeys, its scope and id (else NULL).
type keyArgs struct {
	digest    pgtype.UUID
	lock      int64
	scope, id any
}

func (s *Store) keyArgs(k dedup.Key) keyArgs {
	a := keyArgs{digest: keyDigest(k.Scope, k.ID)}
	a.lock = keyLock(a.digest, s.seed)
	if s.opts.KeepKeys {
		a.scope, a.id = k.Scope, k.ID
	}
	return a
}
