// Command kfake serves a single-broker kfake cluster (franz-go's Kafka
// fake) until it is killed, so that the benchmark harness (test/bench)
// measures Kafka consumers against a broker in its own process rather than
// one sharing the consumer's heap and garbage collector. It prints the
// broker's address on its first line of output.
//
//	kfake [-port 0]
package main

import (
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

func main() {
	port := flag.Int("port", 0, "TCP port to listen on (0: a free port)")
	flag.Parse()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(*port), kfake.GroupMinSessionTimeout(100*time.Millisecond))
	if err != nil {
		log.Fatalf("kfake: %v", err)
	}
	fmt.Println(c.ListenAddrs()[0])
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	c.Close()
}
