-- The baseline of the Kafka batch path: one transaction per fetched batch
-- (here 100 records) inserting the rows in one statement into a table with
-- a primary key on the message id, as every real table has. The ids are
-- time-ordered, as the Go rows' UUIDv7 ids: here 100 numbers in a row from
-- floor_seq, written as uuids in text.
BEGIN;
INSERT INTO floor_bare_pk (id, payload)
SELECT lpad(to_hex(x), 32, '0')::uuid::text, '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea
FROM (SELECT nextval('floor_seq') * 100 AS b) s, generate_series(s.b, s.b + 99) x;
COMMIT;
