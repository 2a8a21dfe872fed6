package fault

import (
	"fmt"
	"os"
	"strings"
)

// State returns the scheduler state of process pid from /proc (Linux): 'R'
// running, 'S' sleeping, 'T' stopped, 'Z' zombie, ...
func State(pid int) (byte, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("fault: state of %d: %w", pid, err)
	}
	// pid (comm) state ...: comm may hold spaces and parentheses, so the
	// state follows the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 >= len(s) {
		return 0, fmt.Errorf("fault: state of %d: unexpected /proc stat %q", pid, s)
	}
	return s[i+2], nil
}
