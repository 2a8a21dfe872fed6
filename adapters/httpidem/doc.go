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
// application/problem+json, RFC 9457, with the Problem* types):
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
//	                           with Retry-After; nothing happened (fail closed)
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
// NewTx takes a dedup.TxStore[pgx.Tx]: a *pgtable.Store, or a
// *twolevel.Store with Redis in front of it. The handler gets the
// transaction with Tx(r.Context()); its writes, the key's row and the
// stored response commit together or not at all, and the response is sent
// after the commit. This is exact for effects in the database: a duplicate
// that arrives while the first transaction runs waits for it in PostgreSQL,
// then replays its response.
//
// How long keys and responses are kept is the store's retention: 24 hours
// (DefaultRetention) for memstore and redisnx; set pgtable.Options.Retention
// to it, and run pgtable's CleanupLoop. Redis marks are best effort (see
// dedup/redisnx).
//
// # Webhooks
//
// NewWebhook and NewWebhookTx receive signed webhooks. The signature (HMAC-
// SHA256 over the timestamp and the raw body, several secrets for rotation,
// a timestamp tolerance, constant-time comparison; VerifySignature) is
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
