// Command chaos runs idem's reliability matrix (see package
// test/chaos). `make chaos` builds and runs it; CHAOS_SCALE=small makes
// the quick run that the test command includes.
//
//	chaos [-scale small|full] [-mult N] [-seed N] [-only REGEXP] [-parallel N] [-v]
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"regexp"
	"syscall"
	"time"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/test/chaos"
)

func main() {
	chaos.ChildMain()

	scale := flag.String("scale", envOr("CHAOS_SCALE", "full"), "small or full (env CHAOS_SCALE)")
	seed := flag.Uint64("seed", 0, "random seed; 0 picks one and prints it (env CHAOS_SEED)")
	only := flag.String("only", os.Getenv("CHAOS_ONLY"), "run only the cells whose name matches this regexp (env CHAOS_ONLY)")
	list := flag.Bool("list", false, "list the cells and exit")
	mult := flag.Int("mult", 0, "multiply the full scale's messages, faults and time limits (env CHAOS_MULT; default 1)")
	parallel := flag.Int("parallel", 0, "cells run at a time; 0: 3 at -scale small, 1 at full (env CHAOS_PARALLEL)")
	verbose := flag.Bool("v", os.Getenv("CHAOS_VERBOSE") != "", "print progress lines")
	flag.Parse()

	if *list {
		for _, n := range chaos.Names() {
			fmt.Println(n)
		}
		return
	}
	if *scale != string(chaos.Small) && *scale != string(chaos.Full) {
		fmt.Fprintf(os.Stderr, "chaos: -scale must be small or full, not %q\n", *scale)
		os.Exit(2)
	}
	if *seed == 0 {
		if s := os.Getenv("CHAOS_SEED"); s != "" {
			if _, err := fmt.Sscan(s, seed); err != nil {
				fmt.Fprintf(os.Stderr, "chaos: CHAOS_SEED: %v\n", err)
				os.Exit(2)
			}
		} else {
			*seed = uint64(time.Now().UnixNano())
		}
	}
	defParallel := 1
	if *scale == string(chaos.Small) {
		defParallel = 3
	}
	*parallel = count("parallel", *parallel, "CHAOS_PARALLEL", defParallel)
	*mult = count("mult", *mult, "CHAOS_MULT", 1)
	var re *regexp.Regexp
	if *only != "" {
		var err error
		if re, err = regexp.Compile(*only); err != nil {
			fmt.Fprintf(os.Stderr, "chaos: -only: %v\n", err)
			os.Exit(2)
		}
	}
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(os.Stderr, "chaos: %v\n", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err = chaos.Run(ctx, chaos.Config{
		Scale:     chaos.Scale(*scale),
		Seed:      *seed,
		Only:      re,
		PGURL:     testenv.PostgresURL(),
		RedisAddr: testenv.RedisAddr(),
		AMQPURL:   testenv.AMQPURL(),
		NATSURL:   testenv.NATSURL(),
		Exe:       exe,
		Verbose:   *verbose,
		Out:       os.Stdout,
		Parallel:  *parallel,
		Mult:      *mult,
	})
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// count returns a count of 1 or more: the flag's value when set, else the
// environment variable's, else def. It exits on anything else.
func count(flagName string, flagValue int, env string, def int) int {
	if flagValue > 0 {
		return flagValue
	}
	if flagValue < 0 {
		fmt.Fprintf(os.Stderr, "chaos: -%s: want 1 or more, not %d\n", flagName, flagValue)
		os.Exit(2)
	}
	s := os.Getenv(env)
	if s == "" {
		return def
	}
	var n int
	if _, err := fmt.Sscan(s, &n); err != nil || n < 1 {
		fmt.Fprintf(os.Stderr, "chaos: %s: want 1 or more, not %q\n", env, s)
		os.Exit(2)
	}
	return n
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
