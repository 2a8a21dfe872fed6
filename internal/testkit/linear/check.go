package linear

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// CheckTimeout bounds the check of one key's history. A check that runs
// out of it fails: a history too large to check is no evidence.
const CheckTimeout = 30 * time.Second

// Violation is a key whose history no order of its operations explains.
type Violation struct {
	Key string
	// Path is the file holding Porcupine's visualization of the key's
	// history (open it in a browser).
	Path string
	// SubHistory lists the operations around the failure: the last steps
	// of the longest order the checker found, and the operations that
	// could come next, none of which the model accepts.
	SubHistory string
	// PathErr says why Path is empty.
	PathErr error
}

// Error describes the violation: the key, where its visualization is, and
// its sub-history.
func (v *Violation) Error() string {
	where := v.Path
	if where == "" {
		where = fmt.Sprintf("none (%v)", v.PathErr)
	}
	return fmt.Sprintf("the history of key %s is not linearizable; visualization: %s\n%s", v.Key, where, v.SubHistory)
}

// Search checks ops key by key against model. It returns the first key
// whose history is not linearizable, with its visualization written to a
// directory of its own (under $IDEM_LINEAR_DIR when set, else the system's
// temporary directory; it is kept for inspection), or nil when every key
// is linearizable. It returns an error when a key's check runs out of
// CheckTimeout (a history too large to check is no evidence); a
// visualization that cannot be written leaves Violation.Path empty and
// its reason in Violation.PathErr.
func Search(name string, model porcupine.Model, ops []porcupine.Operation) (*Violation, error) {
	byKey := map[string][]porcupine.Operation{}
	var keys []string
	for _, op := range ops {
		k := op.Input.(Input).Key
		if byKey[k] == nil {
			keys = append(keys, k)
		}
		byKey[k] = append(byKey[k], op)
	}
	sort.Strings(keys)
	for _, k := range keys {
		res, info := porcupine.CheckOperationsVerbose(model, byKey[k], CheckTimeout)
		switch res {
		case porcupine.Ok:
			continue
		case porcupine.Unknown:
			return nil, fmt.Errorf("%s: the check of key %s (%d operations) ran out of %v; shrink the run", name, k, len(byKey[k]), CheckTimeout)
		}
		v := &Violation{Key: k, SubHistory: subHistory(byKey[k], info, model)}
		dir, err := outDir(name)
		if err != nil {
			v.PathErr = fmt.Errorf("no directory for the visualization: %w", err)
			return v, nil
		}
		v.Path = filepath.Join(dir, "key-"+k+".html")
		if err := porcupine.VisualizePath(model, info, v.Path); err != nil {
			v.PathErr = fmt.Errorf("writing the visualization: %w", err)
			v.Path = ""
		}
		return v, nil
	}
	return nil, nil
}

// Find is Search for a test: it fails t when a key's check runs out of
// CheckTimeout, and logs why a visualization could not be written.
func Find(t testing.TB, name string, model porcupine.Model, ops []porcupine.Operation) *Violation {
	t.Helper()
	v, err := Search(name, model, ops)
	if err != nil {
		t.Fatal(err)
	}
	if v != nil && v.PathErr != nil {
		t.Logf("%s: %v", name, v.PathErr)
	}
	return v
}

// Check fails t when ops, checked key by key against model, are not
// linearizable, printing the failing key's sub-history and where its
// visualization is. It logs the counts of h's results.
func Check(t testing.TB, name string, model porcupine.Model, h *History) {
	t.Helper()
	ops := h.Operations()
	t.Logf("%s: %d operations: %v", name, len(ops), h.Counts())
	if v := Find(t, name, model, ops); v != nil {
		t.Fatalf("%s: %v", name, v)
	}
}

func outDir(name string) (string, error) {
	base := os.Getenv("IDEM_LINEAR_DIR")
	if base != "" {
		if err := os.MkdirAll(base, 0o755); err != nil {
			return "", err
		}
	}
	clean := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' {
			return r
		}
		return '_'
	}, name)
	return os.MkdirTemp(base, "idem-linear-"+clean+"-")
}

// subHistory describes the failure of ops: the last steps of the longest
// partial linearization, then the operations not in it that were called
// before any of them had to return.
func subHistory(ops []porcupine.Operation, info porcupine.LinearizationInfo, model porcupine.Model) string {
	var longest []porcupine.Operation
	for _, part := range info.PartialLinearizationsOperations() {
		for _, seq := range part {
			if len(seq) > len(longest) {
				longest = seq
			}
		}
	}
	type id struct {
		client     int
		call, ret  int64
		kind, resl uint8
	}
	idOf := func(op porcupine.Operation) id {
		return id{op.ClientId, op.Call, op.Return, uint8(op.Input.(Input).Kind), uint8(op.Output.(Output).Result)}
	}
	in := map[id]bool{}
	for _, op := range longest {
		in[idOf(op)] = true
	}
	var rest []porcupine.Operation
	firstRet := int64(-1)
	for _, op := range ops {
		if in[idOf(op)] {
			continue
		}
		rest = append(rest, op)
		if firstRet < 0 || op.Return < firstRet {
			firstRet = op.Return
		}
	}
	sort.Slice(rest, func(i, j int) bool { return rest[i].Call < rest[j].Call })
	line := func(op porcupine.Operation) string {
		ret := ms(op.Return)
		if op.Output.(Output).Result == Unknown {
			ret = "∞"
		}
		return fmt.Sprintf("  client %2d [%s, %s] %s\n", op.ClientId, ms(op.Call), ret, model.DescribeOperation(op.Input, op.Output))
	}
	var b strings.Builder
	fmt.Fprintf(&b, "longest order found: %d of %d operations; its last steps:\n", len(longest), len(ops))
	for _, op := range longest[max(0, len(longest)-8):] {
		b.WriteString(line(op))
	}
	b.WriteString("none of these fits next:\n")
	n := 0
	for _, op := range rest {
		if op.Call > firstRet || n == 20 {
			break
		}
		b.WriteString(line(op))
		n++
	}
	return b.String()
}
