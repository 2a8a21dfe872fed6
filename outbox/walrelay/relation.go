package walrelay

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/outbox"
)

// relation is a table as pgoutput describes it (a RelationMessage): the
// outbox table's columns are found by name.
type relation struct {
	schema, name string
	cols         map[string]int
	oids         []uint32
}

func newRelation(m *pglogrepl.RelationMessage) *relation {
	r := &relation{schema: m.Namespace, name: m.RelationName, cols: make(map[string]int, len(m.Columns)), oids: make([]uint32, len(m.Columns))}
	for i, c := range m.Columns {
		r.cols[c.Name] = i
		r.oids[i] = c.DataType
	}
	return r
}

func (r *relation) is(schema, table string) bool { return r.schema == schema && r.name == table }

// decode reads an inserted row of the outbox table (pgoutbox's layout).
func (r *relation) decode(types *pgtype.Map, t *pglogrepl.TupleData) (*outbox.Message, error) {
	var (
		id      pgtype.UUID
		topic   string
		key     []byte
		payload []byte
		headers *string
		created time.Time
	)
	for _, c := range []struct {
		name     string
		dst      any
		nullable bool
	}{
		{"id", &id, false}, {"topic", &topic, false}, {"key", &key, false},
		{"payload", &payload, false}, {"headers", &headers, true}, {"created_at", &created, false},
	} {
		i, ok := r.cols[c.name]
		if !ok || i >= len(t.Columns) {
			return nil, fmt.Errorf("column %s is missing: the table does not have the outbox layout", c.name)
		}
		col := t.Columns[i]
		var err error
		switch col.DataType {
		case pglogrepl.TupleDataTypeBinary:
			err = types.Scan(r.oids[i], pgtype.BinaryFormatCode, col.Data, c.dst)
		case pglogrepl.TupleDataTypeText:
			err = types.Scan(r.oids[i], pgtype.TextFormatCode, col.Data, c.dst)
		case pglogrepl.TupleDataTypeNull:
			if !c.nullable {
				err = fmt.Errorf("is NULL")
			}
		default:
			err = fmt.Errorf("has no value (tuple data type %q)", col.DataType)
		}
		if err != nil {
			return nil, fmt.Errorf("column %s: %w", c.name, err)
		}
	}
	if !id.Valid {
		return nil, fmt.Errorf("column id is NULL")
	}
	m := &outbox.Message{
		ID:        id.String(),
		Topic:     topic,
		Payload:   payload,
		CreatedAt: created,
	}
	if len(key) > 0 {
		m.Key = key
	}
	if m.Payload == nil {
		m.Payload = []byte{}
	}
	if headers != nil && *headers != "{}" {
		m.Headers = jsonHeaders(*headers)
	}
	return m, nil
}

// jsonHeaders reads the headers column. Enqueue writes string values only;
// other JSON values (written by hand) are kept as their JSON text.
func jsonHeaders(js string) map[string]string {
	var raw map[string]json.RawMessage
	if json.Unmarshal([]byte(js), &raw) != nil {
		return nil
	}
	h := make(map[string]string, len(raw))
	for k, v := range raw {
		var s string
		if json.Unmarshal(v, &s) == nil {
			h[k] = s
		} else {
			h[k] = string(v)
		}
	}
	return h
}
