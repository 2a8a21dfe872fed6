//go:build !linux

package childproc

import (
	"os/exec"
	"syscall"
)

// SetDeathSignal does nothing where there is no parent-death signal.
func SetDeathSignal(*exec.Cmd, syscall.Signal) {}
