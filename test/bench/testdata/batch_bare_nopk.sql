-- batch_bare.sql into a table without an index: a reference, below what a
-- real table costs.
BEGIN;
INSERT INTO floor_bare (id, payload)
SELECT lpad(to_hex(x), 32, '0')::uuid::text, '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea
FROM (SELECT nextval('floor_seq') * 100 AS b) s, generate_series(s.b, s.b + 99) x;
COMMIT;
