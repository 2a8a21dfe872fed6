// Command redisonly is a service that deduplicates requests with httpidem
// on Redis alone; its imports must not pull in a database driver.
package main

import (
	"log"
	"net/http"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/dedup/redisnx"
)

func main() {
	store, err := redisnx.New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"}), redisnx.Options{})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := httpidem.New(store, httpidem.Options{})
	if err != nil {
		log.Fatal(err)
	}
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", mw.Handler(http.NotFoundHandler())))
}
