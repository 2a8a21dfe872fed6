package chaos

import "testing"

func TestPgBouncerCellsRegistered(t *testing.T) {
	mu.Lock()
	defer mu.Unlock()
	for _, n := range []string{"pgbouncer/pgtable/sigkill", "pgbouncer/pgtable/bouncer-kill", "pgbouncer/relay/kafka/sigkill"} {
		c, ok := cells[n]
		if !ok {
			t.Errorf("cell %s is not registered", n)
			continue
		}
		if c.ExpectDuplicates || c.Last {
			t.Errorf("cell %s: ExpectDuplicates %v, Last %v; want a cell that promises 0 duplicates, in the main run", n, c.ExpectDuplicates, c.Last)
		}
	}
}
