-- The baseline of the per-message transactional paths (Kafka, RabbitMQ,
-- Watermill, pgtable in a business transaction): the handler's own
-- transaction with the business INSERT, three round trips (pgx.BeginFunc).
\set k random(1, 4000000000000000000)
BEGIN;
INSERT INTO floor_bare (id, payload) VALUES ('m-' || :k::text, '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
COMMIT;
