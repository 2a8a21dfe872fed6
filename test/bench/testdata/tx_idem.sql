-- What pgtable's Process sends for a first delivery (consumer.Transactional,
-- the Watermill and RabbitMQ transactional paths), in the same three round
-- trips: BEGIN, the key's advisory lock and the read of its row; the
-- handler's INSERT; the key's row, completed, and COMMIT.
\set k random(1, 4000000000000000000)
\set a random(-2147483648, 2147483647)
\set b random(-2147483648, 2147483647)
\startpipeline
BEGIN;
SELECT pg_advisory_xact_lock(:a, :b);
SELECT CASE WHEN e.token IS NULL THEN 2 ELSE 1 END::smallint, e.fingerprint, e.result,
       CASE WHEN e.token IS NOT NULL THEN GREATEST(0, (extract(epoch FROM (e.expires_at - clock_timestamp())) * 1000)::bigint) END,
       (e.expires_at <= clock_timestamp())
FROM floor_claims e WHERE e.key = md5(:k::text)::uuid;
\endpipeline
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text, '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
\startpipeline
INSERT INTO floor_claims (key, expires_at, fingerprint, result, scope, id)
VALUES (md5(:k::text)::uuid, clock_timestamp() + 604800000 * interval '1 millisecond', sha256(:k::text::bytea), NULL, NULL, NULL);
COMMIT;
\endpipeline
