// Package httpidem makes HTTP endpoints safe to retry: an Idempotency-Key
// middleware for net/http on idem's stores, a receiver for signed webhooks
// that runs each event once, and a retrying client that sends one key per
// operation. (It is named httpidem so that it does not clash with
// net/http.)
//
// # Server
//
// A client sends a unique key with each non-idempotent request and the same
// key on every retry of it (the IETF draft "The Idempotency-Key HTTP Header
// Field", and Stripe before it):
//
//	POST /payments HTTP/1.1
//	Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"
//
// The middleware (New, NewTx; Middleware.Handler) runs the handler once per
// key and answers every retry with the first response:
//
//   - The key is read as a Structured Field String or a bare token, at most
//     Options.MaxKeyLen (255) bytes, visible ASCII only (ParseKey).
//   - The key's scope is the principal (Options.Principal; default none,
//     unsafe for multi-tenant APIs), the method and the route
//     (Options.Route; default the ServeMux pattern, or the path): one
//     client's key never replays another's response.
//   - The fingerprint is SHA-256 over the method, route, request target and
//     body (Options.Fingerprint). The body is read once, up to
//     Options.MaxBodyBytes, before anything is claimed, and given back to
//     the handler from memory.
//   - The handler writes to a buffer. Nothing reaches the client before the
//     response is stored (lease stores) or committed together with the
//     handler's own writes (transactional stores).
//   - Which responses are stored is Options.StoreResponse; by default, as
//     at Stripe, every 2xx to 5xx of a handler that started, except 401, 403
//     and 429. A response that is not stored, a handler that panicked or
//     called Release, releases the key: the retry runs the handler again.
//
// Status codes the middleware answers with itself (error bodies are
// application/problem+json, RFC 9457, with the types listed at Problem.Type):
//
//	status                     when                                                    stored
//	400 Bad Request            key missing (method in Options.Methods), empty,         no
//	                           longer than MaxKeyLen, control or non-ASCII bytes,
//	                           malformed string, several Idempotency-Key fields
//	413 Content Too Large      body longer than MaxBodyBytes (before any claim)        no
//	422 Unprocessable Content  same key, another request (fingerprint differs)        no
//	409 Conflict               the first request with the key is still running;        no
//	                           with Retry-After (or wait up to Options.Wait)
//	(stored status)            replay of the first response, with the stored           —
//	                           headers and Idempotent-Replayed: true
//	500 Internal Server Error  the response passed MaxResponseBytes (see Options)      lease: yes
//	503 Service Unavailable    the store failed, or the transaction did not commit;    no
//	                           with Retry-After; this request changed nothing (fail
//	                           closed), unless the detail says its outcome is unknown
//	                           (PostgreSQL unreachable after a broken COMMIT). An
//	                           earlier request with the key may have been processed
//	                           (a store that cannot be reached says its outcome is
//	                           unknown): a retry with the key then replays or runs
//
// # Stores
//
// New takes any dedup.LeaseStore: dedup/memstore, dedup/redisnx, or the lease
// mode of dedup/pgtable. The key is claimed before the handler, the lease is
// extended while it runs, and the encoded response is stored with Complete.
// A lease protects effects outside the database (a call to a payment
// provider), at-least-once: a crash between the effect and Complete lets a
// retry run again once the lease ran out.
//
// NewTx takes a transactional store of any transaction type: a
// *pgtable.Store (pgx.Tx), a *sqltable.Store (*sql.Tx, on PostgreSQL,
// MySQL, MariaDB or SQLite), or a *twolevel.Store with Redis in front of
// either. The handler gets the transaction with Tx[T](r.Context()) (T is
// pgx.Tx on pgtable, *sql.Tx on sqltable); its writes, the key's row and
// the stored response commit together or not at all, and the response is sent
// after the commit. This is exact for effects in the database. When the
// commit fails with an unknown outcome (the connection broke during COMMIT),
// the middleware claims the key again on a new connection before it
// answers: a transaction that committed is answered with the replay of its
// response, and 503 only means that it did not commit (or that PostgreSQL
// cannot tell yet; a retry with the same key then replays or runs).
//
// pgtable begins the transaction with the key's row (the claim, sent with
// BEGIN), runs the handler, and adds the encoded response to the row at
// commit: the key's row is the only write beside the handler's, in the round
// trips of the handler's own transaction. A duplicate that arrives while the first
// request runs waits for that transaction in PostgreSQL (up to the
// connection's lock_timeout, if set, then 409), then replays the first
// response; it runs if the first rolled back. So does a claim of a New
// middleware on pgtable's lease mode and the same table.
//
// How long keys and responses are kept is the store's retention: 24 hours
// (Stripe's) for memstore and redisnx; set pgtable.Options.Retention to 24
// hours, and run pgtable's CleanupLoop. Redis marks are best effort (see
// dedup/redisnx).
//
// # Metrics and traces
//
// With Options.MeterProvider (default: the OpenTelemetry global, a no-op
// until the application installs one) each request under the middleware
// is counted once. Attributes: idem.scope, the value of
// Options.MetricScope (default: the ServeMux pattern, or the method) —
// never the key's scope, which holds the principal, nor the key — and
// idem.store.
//
//	metric                          values
//	idem.claims (idem.outcome)      first: the handler runs
//	                                duplicate: a stored response is replayed
//	                                in_flight: 409 (after Options.Wait, if any)
//	                                fingerprint_mismatch: 422
//	                                invalid_key: 400, the key missing or malformed
//	                                error: 503, the store failed
//	idem.claim.duration             time to the claim's answer, waits included
//	idem.handler.duration           completed (stored), released (not stored,
//	                                or rolled back), lease_lost, complete_failed
//	idem.lease.lost                 leases that ran out while the handler ran
//	idem.lease.wait.duration        Options.Wait's waits, by idem.wait.outcome:
//	                                replayed, acquired (the first released the
//	                                key), timed_out (409), cancelled (the client
//	                                left, or the request's deadline passed),
//	                                error
//	idem.messages (idem.result)     ack: the answer is stored (processed,
//	                                replayed; a lease store's stored 500)
//	                                retry: nothing is stored, the same request
//	                                can run again (409, 503, a response not
//	                                stored, a lost lease, a panic)
//	                                dead_letter: never runs with this key
//	                                (idem.reason fingerprint_mismatch: 422;
//	                                invalid_key: 400; body_too_large: 413;
//	                                signature_invalid: webhooks' 401)
//	messaging.process.duration      time from the request's arrival to the answer
//
// idem.messages and messaging.process.duration carry messaging.system
// "http" and the metric scope as messaging.destination.name. A request
// without a key on an Optional route, or of a method not in Options.Methods,
// is not counted.
//
// With Options.TracerProvider, a request whose context holds a recording
// span (started by otelhttp, say) gets idem.claim, idem.handle and
// idem.complete (transactional stores: idem.commit) spans as its children,
// with the key's hash (idem.key.hash); the handler runs under idem.handle.
// Logs (Options.Logger, discarded by default) carry the key's hash too,
// never the key or the principal.
//
// # Webhooks
//
// NewWebhook and NewWebhookTx receive signed webhooks. The signature (HMAC-
// SHA256 over the timestamp and the raw body, several secrets for rotation,
// a timestamp tolerance, constant-time comparison) is
// checked before the event id is claimed, so a forged request that reuses a
// real event id is refused (401) without a claim and cannot block the real
// event. A duplicate is answered with the stored 2xx so the provider stops
// retrying; a failed delivery is not stored, so the provider's retry runs
// it again.
//
// # Client
//
// Transport is an http.RoundTripper that gives each operation one key (the
// request's header, WithKey, or a new UUID) and retries network errors,
// 409, 429 and 5xx with exponential backoff and full jitter, honouring
// Retry-After, with the same key on every attempt, within MaxAttempts and
// MaxElapsed.
package httpidem
