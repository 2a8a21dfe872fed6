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
	if *parallel == 0 {
		if s := os.Getenv("CHAOS_PARALLEL"); s != "" {
			if _, err := fmt.Sscan(s, parallel); err != nil || *parallel < 1 {
				fmt.Fprintf(os.Stderr, "chaos: CHAOS_PARALLEL: want a number of cells above 0, not %q\n", s)
				os.Exit(2)
			}
		} else if *scale == string(chaos.Small) {
			*parallel = 3
		} else {
			*parallel = 1
		}
	}
	if *mult == 0 {
		*mult = 1
		if s := os.Getenv("CHAOS_MULT"); s != "" {
			if _, err := fmt.Sscan(s, mult); err != nil || *mult < 1 {
				fmt.Fprintf(os.Stderr, "chaos: CHAOS_MULT: want a multiple of 1 or more, not %q\n", s)
				os.Exit(2)
			}
		}
	}
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

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
