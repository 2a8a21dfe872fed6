-- What kafkapg.OffsetsOnly sends for a batch of 100 records past the stored
-- position, in the three round trips of the baseline: BEGIN and the
-- compare-and-set of the partition's position (one UPDATE, no row per
-- message); the handler's one INSERT for the batch, as the baseline's;
-- COMMIT.
\startpipeline
BEGIN;
UPDATE floor_offsets SET next_offset = next_offset + 100, updated_at = clock_timestamp()
WHERE group_id = 'g' AND topic = 'o' AND partition = :client_id AND next_offset <= 9223372036854775000;
\endpipeline
INSERT INTO floor_idem_pk (id, payload)
SELECT lpad(to_hex(x), 32, '0')::uuid::text, '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea
FROM (SELECT nextval('floor_seq') * 100 AS b) s, generate_series(s.b, s.b + 99) x;
COMMIT;
