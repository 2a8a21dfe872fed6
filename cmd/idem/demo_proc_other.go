//go:build !linux

package main

import "os/exec"

// setDeathSignal does nothing where there is no parent-death signal: a child
// whose demo died stops when its stdin ends.
func setDeathSignal(*exec.Cmd) {}
