package chaos

import (
	"os/exec"
	"syscall"
)

// setDeathSignal makes the child die with the runner: a runner killed or
// interrupted leaves no consumer behind.
func setDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
