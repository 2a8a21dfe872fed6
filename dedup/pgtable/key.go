package pgtable

import (
	"crypto/sha256"
	"encoding/binary"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/dedup"
)

// keyDigest is the first 16 bytes of SHA-256(scope || 0x00 || id), as a
// uuid (fixed size, no length header): the primary key of a key's row.
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

// timePrefixLen is the length of the time prefix of a time-ordered row key:
// the 48 bits a UUID of version 6 or 7 starts with.
const timePrefixLen = 6

// orderedKey is the row key of Options.TimeOrderedKeys for an id whose time
// prefix is prefix: the prefix, then the first 10 bytes of the key's digest
// d. Keys of ids made at nearby times sort next to each other.
func orderedKey(prefix [timePrefixLen]byte, d pgtype.UUID) pgtype.UUID {
	k := pgtype.UUID{Valid: true}
	copy(k.Bytes[:timePrefixLen], prefix[:])
	copy(k.Bytes[timePrefixLen:], d.Bytes[:16-timePrefixLen])
	return k
}

// timePrefix returns the first 48 bits of id when id is a UUID of version 6
// or 7 in its canonical text form (8-4-4-4-12 hexadecimal digits, either
// case): a timestamp, big-endian, so they grow with the time the id was
// made. ok is false for any other id.
func timePrefix(id string) (p [timePrefixLen]byte, ok bool) {
	if len(id) != 36 || id[8] != '-' || id[13] != '-' || id[18] != '-' || id[23] != '-' || (id[14] != '6' && id[14] != '7') {
		return p, false
	}
	n := 0 // hex digits read
	for i := 0; i < len(id); i++ {
		if i == 8 || i == 13 || i == 18 || i == 23 {
			continue
		}
		v, ok := unhex(id[i])
		if !ok {
			return p, false
		}
		if n < 2*timePrefixLen {
			p[n/2] |= v << (4 * (1 - n%2))
		}
		n++
	}
	return p, true
}

func unhex(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// keySQL is the SQL expression of the row key of the text expressions scope
// and id: keyDigest, or with ordered (Options.TimeOrderedKeys) the
// time-ordered key of an id that is a UUID of version 6 or 7.
func keySQL(scope, id string, ordered bool) string {
	digest := "sha256(convert_to(" + scope + ", 'UTF8') || decode('00', 'hex') || convert_to(" + id + ", 'UTF8'))"
	plain := "encode(substring(" + digest + " FROM 1 FOR 16), 'hex')::uuid"
	if !ordered {
		return plain
	}
	return "CASE WHEN " + id + " ~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[67][0-9a-fA-F]{3}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$' " +
		"THEN (substring(replace(" + id + ", '-', '') FROM 1 FOR 12) || encode(substring(" + digest + " FROM 1 FOR 10), 'hex'))::uuid " +
		"ELSE " + plain + " END"
}

// keyLock is the advisory lock key of a key's digest in the table of seed
// (lockSeed): the digest's first 8 bytes, XORed with the seed so that the
// same key in two tables takes two locks.
func keyLock(d pgtype.UUID, seed int64) int64 {
	return int64(binary.BigEndian.Uint64(d.Bytes[:8])) ^ seed
}

// keyArgs is what a statement needs of a key: its row key (digest: the
// key's digest, or its time-ordered form), its lock and, with
// Options.KeepKeys, its scope and id (else NULL).
type keyArgs struct {
	digest    pgtype.UUID
	lock      int64
	scope, id any
}

// rowKey returns the primary key of k's row (see Options.TimeOrderedKeys)
// and k's digest.
func (s *Store) rowKey(k dedup.Key) (row, digest pgtype.UUID) {
	digest = keyDigest(k.Scope, k.ID)
	if s.opts.TimeOrderedKeys {
		if p, ok := timePrefix(k.ID); ok {
			return orderedKey(p, digest), digest
		}
	}
	return digest, digest
}

func (s *Store) keyArgs(k dedup.Key) keyArgs {
	row, digest := s.rowKey(k)
	a := keyArgs{digest: row, lock: keyLock(digest, s.seed)}
	if s.opts.KeepKeys {
		a.scope, a.id = k.Scope, k.ID
	}
	return a
}
