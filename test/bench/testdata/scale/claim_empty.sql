-- The statements of a claim in pgtable (advisory lock, read of the key's row, insert) on idem_scale.empty; see setup.sql.
\set k random(1, 4000000000000000000)
\set a random(-2147483648, 2147483647)
\set b random(-2147483648, 2147483647)
\startpipeline
BEGIN;
SELECT pg_advisory_xact_lock(:a, :b);
SELECT e.token, e.fingerprint, e.result, e.expires_at FROM idem_scale.empty e WHERE e.key = md5(:k::text)::uuid;
\endpipeline
\startpipeline
INSERT INTO idem_scale.empty (key, expires_at) VALUES (md5(:k::text)::uuid, clock_timestamp() + interval '1 day');
COMMIT;
\endpipeline
