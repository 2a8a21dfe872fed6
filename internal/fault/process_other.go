//go:build unix && !linux

package fault

import (
	"errors"
	"syscall"
)

// setDeathSignal does nothing where there is no parent-death signal.
func setDeathSignal(*syscall.SysProcAttr, syscall.Signal) {}

// State needs /proc (Linux).
func State(int) (byte, error) {
	return 0, errors.New("fault: State reads /proc, which this system does not have")
}
