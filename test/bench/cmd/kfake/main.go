// Command kfake serves a single-broker kfake cluster (franz-go's Kafka
// fake) until it is killed, so that the benchmark harness (test/bench)
// measures Kafka consumers against a broker in its own process rather than
// one sharing the consumer's heap and garbage collector. It prints the
// broker's address on its first line of output. With -stdin it also stops
// when its standard input closes, so that it does not outlive a harness
// that was killed.
//
//	kfake [-port 0] [-stdin]
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

func main() {
	port := flag.Int("port", 0, "TCP port to listen on (0: a free port)")
	stdin := flag.Bool("stdin", false, "stop when standard input closes")
	flag.Parse()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(*port), kfake.GroupMinSessionTimeout(100*time.Millisecond))
	if err != nil {
		log.Fatalf("kfake: %v", err)
	}
	fmt.Println(c.ListenAddrs()[0])
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	if *stdin {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			sig <- syscall.SIGTERM
		}()
	}
	<-sig
	c.Close()
}
