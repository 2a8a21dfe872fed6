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
	// fields holds the header of a decoded record with few fields, so
	// that it takes one allocation with the record.
	fields [4][2]string
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
		b = appendField(b, f[0], f[1])
	}
	return append(b, r.body...)
}

// decodeRecord parses a stored response. It never panics, whatever b holds:
// a result written by something else under the same key is an error. It
// runs on every replay, so the header fields share one string, and a
// record of up to four fields takes one allocation besides.
func decodeRecord(b []byte) (*record, error) {
	if len(b) < len(recordMagic)+2 || [3]byte(b[:3]) != recordMagic {
		return nil, fmt.Errorf("%w: no httpidem header (%d bytes)", errRecord, len(b))
	}
	status := int(binary.BigEndian.Uint16(b[3:5]))
	if status < 200 || status > 999 {
		return nil, fmt.Errorf("%w: status %d", errRecord, status)
	}
	b = b[5:]
	count, n := binary.Uvarint(b)
	if n <= 0 || count > uint64(len(b)) {
		return nil, fmt.Errorf("%w: header count", errRecord)
	}
	b = b[n:]
	// First pass: the extent of the fields, every length checked.
	end := 0
	for range 2 * count {
		l, n := binary.Uvarint(b[end:])
		if n <= 0 || l > uint64(len(b)-end-n) {
			return nil, fmt.Errorf("%w: header field length", errRecord)
		}
		end += n + int(l)
	}
	r := &record{status: status, body: b[end:]}
	r.header = r.fields[:0]
	if count > uint64(len(r.fields)) {
		r.header = make([][2]string, 0, count)
	}
	// Second pass: the fields, as substrings of one copy.
	hs := string(b[:end])
	off := 0
	for range count {
		var f [2]string
		for j := range f {
			l, n := binary.Uvarint(b[off:end])
			f[j] = hs[off+n : off+n+int(l)]
			off += n + int(l)
		}
		if !isToken(f[0]) || !validFieldValue(f[1]) {
			return nil, fmt.Errorf("%w: header field %q", errRecord, f[0])
		}
		r.header = append(r.header, f)
	}
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

// encodeResponse encodes a handler's response for storing, keeping the
// fields of h named in names (canonical keys), in that order: what a record
// of them would encode to, without building the record.
func encodeResponse(status int, h http.Header, names []string, body []byte) []byte {
	count, n := 0, len(recordMagic)+2+binary.MaxVarintLen64+len(body)
	for _, name := range names {
		for _, v := range h[name] {
			count++
			n += 2*binary.MaxVarintLen64 + len(name) + len(v)
		}
	}
	b := make([]byte, 0, n)
	b = append(b, recordMagic[:]...)
	b = binary.BigEndian.AppendUint16(b, uint16(status))
	b = binary.AppendUvarint(b, uint64(count))
	for _, name := range names {
		for _, v := range h[name] {
			b = appendField(b, name, v)
		}
	}
	return append(b, body...)
}

func appendField(b []byte, name, value string) []byte {
	b = binary.AppendUvarint(b, uint64(len(name)))
	b = append(b, name...)
	b = binary.AppendUvarint(b, uint64(len(value)))
	return append(b, value...)
}

// bodyAllowed reports whether a response with this status may have a body.
func bodyAllowed(status int) bool {
	return status != http.StatusNoContent && status != http.StatusNotModified && (status < 100 || status > 199)
}
