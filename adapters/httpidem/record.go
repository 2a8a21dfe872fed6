package httpidem

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
)

// A stored response is the store's result bytes for a completed key:
//
//	"hi" 0x01                    magic and format version
//	uint16 big endian            status code
//	uvarint                      number of header fields
//	per field: uvarint len, name, uvarint len, value
//	the rest                     the body
//
// Only the headers of Options.ReplayHeaders are kept, in the order the
// handler set them.
var recordMagic = [3]byte{'h', 'i', 1}

// errRecord is wrapped by decodeRecord's errors.
var errRecord = errors.New("httpidem: stored response is malformed")

// record is a response to store or replay.
type record struct {
	status int
	header [][2]string
	body   []byte
}

func (r *record) encode() []byte {
	n := len(recordMagic) + 2 + binary.MaxVarintLen64 + len(r.body)
	for _, f := range r.header {
		n += 2*binary.MaxVarintLen64 + len(f[0]) + len(f[1])
	}
	b := make([]byte, 0, n)
	b = append(b, recordMagic[:]...)
	b = binary.BigEndian.AppendUint16(b, uint16(r.status))
	b = binary.AppendUvarint(b, uint64(len(r.header)))
	for _, f := range r.header {
		b = binary.AppendUvarint(b, uint64(len(f[0])))
		b = append(b, f[0]...)
		b = binary.AppendUvarint(b, uint64(len(f[1])))
		b = append(b, f[1]...)
	}
	return append(b, r.body...)
}

// decodeRecord parses a stored response. It never panics, whatever b holds:
// a result written by something else under the same key is an error.
func decodeRecord(b []byte) (*record, error) {
	if len(b) < len(recordMagic)+2 || [3]byte(b[:3]) != recordMagic {
		return nil, fmt.Errorf("%w: no httpidem header (%d bytes)", errRecord, len(b))
	}
	r := &record{status: int(binary.BigEndian.Uint16(b[3:5]))}
	if r.status < 200 || r.status > 999 {
		return nil, fmt.Errorf("%w: status %d", errRecord, r.status)
	}
	b = b[5:]
	count, n := binary.Uvarint(b)
	if n <= 0 || count > uint64(len(b)) {
		return nil, fmt.Errorf("%w: header count", errRecord)
	}
	b = b[n:]
	if count > 0 {
		r.header = make([][2]string, 0, count)
	}
	for range count {
		var f [2]string
		for j := range f {
			l, n := binary.Uvarint(b)
			if n <= 0 || l > uint64(len(b)-n) {
				return nil, fmt.Errorf("%w: header field length", errRecord)
			}
			f[j] = string(b[n : n+int(l)])
			b = b[n+int(l):]
		}
		if !isToken(f[0]) || !validFieldValue(f[1]) {
			return nil, fmt.Errorf("%w: header field %q", errRecord, f[0])
		}
		r.header = append(r.header, f)
	}
	r.body = b
	return r, nil
}

// validFieldValue reports whether v may be sent as a header field value: no
// control bytes other than tab, no DEL.
func validFieldValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < 0x20 && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// newRecord keeps the fields of h named in names (canonical keys).
func newRecord(status int, h http.Header, names []string, body []byte) *record {
	r := &record{status: status, body: body}
	for _, name := range names {
		for _, v := range h[name] {
			r.header = append(r.header, [2]string{name, v})
		}
	}
	return r
}

// bodyAllowed reports whether a response with this status may have a body.
func bodyAllowed(status int) bool {
	return status != http.StatusNoContent && status != http.StatusNotModified && (status < 100 || status > 199)
}
