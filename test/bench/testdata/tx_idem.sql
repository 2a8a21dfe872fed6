-- What pgtable's Process sends for a first delivery (consumer.Transactional,
-- the Watermill and RabbitMQ transactional paths), in the same three round
-- trips: BEGIN and the claim (the key's row, INSERT ... ON CONFLICT DO
-- NOTHING); the handler's INSERT; COMMIT.
\set k random(1, 4000000000000000000)
\startpipeline
BEGIN;
INSERT INTO floor_claims (key, expires_at, fingerprint, scope, id)
VALUES (md5(:k::text)::uuid, clock_timestamp() + 604800000 * interval '1 millisecond', sha256(:k::text::bytea), NULL, NULL)
ON CONFLICT (key) DO NOTHING;
\endpipeline
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text, '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
COMMIT;
