package main

import (
	"os/exec"
	"syscall"
)

// setDeathSignal makes the kernel SIGKILL the child when the demo dies, so
// that no consumer outlives it even when the demo itself is SIGKILLed.
func setDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
