// Package msgcheck holds the limits an outgoing message must meet to be
// stored by outbox/pgoutbox (a text topic, jsonb headers) and, so that either
// source accepts the same messages, by outbox/walrelay.
package msgcheck

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/idemkit/idem/dedup"
)

// MaxHeaderBytes bounds a header name plus value, in bytes.
const MaxHeaderBytes = 64 << 10

// Topic checks that a topic is valid UTF-8 text without NUL bytes.
func Topic(topic string) error {
	if !utf8.ValidString(topic) || strings.ContainsRune(topic, 0) {
		return fmt.Errorf("Message.Topic %q is not valid UTF-8 text", topic)
	}
	return nil
}

// Headers checks that every header has a name, fits MaxHeaderBytes, and
// is valid UTF-8 without NUL bytes (jsonb keeps text only).
func Headers(h map[string]string) error {
	for k, v := range h {
		if k == "" {
			return errors.New("a header name is empty")
		}
		if len(k)+len(v) > MaxHeaderBytes {
			return fmt.Errorf("header %q is longer than %d bytes", k, MaxHeaderBytes)
		}
		if !utf8.ValidString(k) || !utf8.ValidString(v) || strings.ContainsRune(k, 0) || strings.ContainsRune(v, 0) {
			return fmt.Errorf("header %q: names and values must be valid UTF-8 without NUL bytes", k)
		}
	}
	return nil
}

// ID is the id of a message whose Message.ID is s: a new time-ordered
// UUID (v7) when s is empty, else s, which must be a UUID.
func ID(s string) (uuid.UUID, error) {
	if s == "" {
		return uuid.NewV7()
	}
	id, err := uuid.Parse(s)
	if err != nil {
		return uuid.UUID{}, fmt.Errorf("Message.ID #%s is not a UUID (leave it empty for a generated UUIDv7): %w", dedup.HashKey("", s), err)
	}
	return id, nil
}
