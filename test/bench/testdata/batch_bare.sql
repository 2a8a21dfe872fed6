-- The baseline of the Kafka batch path: one transaction per fetched batch
-- (here 100 records) inserting the rows in one statement.
\set k random(1, 4000000000000000000)
BEGIN;
INSERT INTO floor_bare (id, payload)
SELECT 'm-' || :k::text || '-' || g, '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea FROM generate_series(1, 100) g;
COMMIT;
