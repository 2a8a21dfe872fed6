//go:build !(linux || darwin || freebsd || netbsd || openbsd)

package main

import "os"

// ttyColumns returns 0: the width of a terminal is not asked here, COLUMNS
// or the default applies.
func ttyColumns(*os.File) int { return 0 }
