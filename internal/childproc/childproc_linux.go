package childproc

import (
	"os/exec"
	"syscall"
)

// SetDeathSignal makes the kernel send sig to cmd's process when the OS
// thread that started it dies (with the whole parent, or earlier if that
// thread exits while locked to its goroutine).
func SetDeathSignal(cmd *exec.Cmd, sig syscall.Signal) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = sig
}
