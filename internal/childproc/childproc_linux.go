package childproc

import (
	"os/exec"
	"syscall"
)

// setDeathSignal makes the kernel SIGKILL the child when its parent dies.
func setDeathSignal(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}
