package sqloutbox_test

import (
	"io"
	"log"
	"testing"

	"github.com/go-sql-driver/mysql"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestMain runs the tests under a goroutine leak check. The MySQL driver's
// own log lines (a connection killed on purpose) are dropped.
func TestMain(m *testing.M) {
	_ = mysql.SetLogger(log.New(io.Discard, "", 0))
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}
