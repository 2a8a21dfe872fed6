//go:build !unix

package pgbouncer

import (
	"errors"
	"time"
)

type proc struct{}

func startProc(_, _, _ string) (*proc, error) {
	return nil, errors.New("the throwaway pgbouncer needs a Unix system")
}

func (*proc) exited() bool       { return true }
func (*proc) exitErr() error     { return errors.New("not started") }
func (*proc) kill()              {}
func (*proc) stop(time.Duration) {}
