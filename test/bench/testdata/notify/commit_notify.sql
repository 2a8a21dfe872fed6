-- The same transaction with the notification pgoutbox's Enqueue sends: at
-- commit, PostgreSQL holds the notification queue's lock through the
-- commit's flush, so these commits do not share flushes.
BEGIN;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (1, 1, 1, 1, now());
SELECT pg_notify('idem_outbox', '');
COMMIT;
