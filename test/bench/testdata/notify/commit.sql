-- A transaction that inserts one row and commits (pgbench's own history
-- table, made by pgbench -i): the business write alone.
BEGIN;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (1, 1, 1, 1, now());
COMMIT;
