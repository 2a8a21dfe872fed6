// Command bench runs idem's benchmark table (test/bench) and prints it:
// each production path against the baseline a user would write, side by
// side, the SQL floors of the database paths, and the Redis paths'
// commands sent by hand. `make bench` builds and runs it; `make bench
// QUICK=1` is a smoke run of a few minutes.
//
//	bench [-quick] [-rounds 3] [-only REGEXP] [-kfake PATH] [-cpuprofile FILE]
//
// -cpuprofile writes a CPU profile of the bench process: the idem code and
// the baselines, not the brokers and databases it runs against.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"regexp"
	"runtime/pprof"
	"syscall"

	"github.com/idemkit/idem/test/bench"
)

func main() { os.Exit(run()) }

func run() int {
	var cfg bench.Config
	only := flag.String("only", "", "run only the rows whose path matches this regular expression")
	flag.BoolVar(&cfg.Quick, "quick", false, "a smoke run of a few minutes: small rounds, noisy figures")
	flag.IntVar(&cfg.Rounds, "rounds", 3, "measured rounds per row (medians are reported)")
	flag.StringVar(&cfg.Kfake, "kfake", "", "the kfake command (test/bench/cmd/kfake); defaults to kfake next to this binary")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of this process to this file")
	flag.Parse()
	if *only != "" {
		re, err := regexp.Compile(*only)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench: -only:", err)
			return 2
		}
		cfg.Only = re
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench: -cpuprofile:", err)
			return 2
		}
		defer func() {
			pprof.StopCPUProfile()
			_ = f.Close()
		}()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := bench.Run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		return 1
	}
	return 0
}
