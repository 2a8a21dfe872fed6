package main

import (
	"testing"
	"time"
)

// TestExample runs the program on its in-process kfake cluster, as
// `go run ./examples/kafka` does.
func TestExample(t *testing.T) {
	if err := run("", "", 300, 30, 2, time.Minute); err != nil {
		t.Fatal(err)
	}
}
