//go:build unix && !linux

package fault

import (
	"errors"
	"syscall"
)

// State needs /proc (Linux).
func State(int) (byte, error) {
	return 0, errors.New("fault: State reads /proc, which this system does not have")
}
