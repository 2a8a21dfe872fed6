-- batch_idem.sql with the handler's INSERT into a table without an index:
-- the statements of the reference row, against batch_bare_nopk.sql.
\startpipeline
BEGIN;
INSERT INTO floor_claims (key, expires_at, fingerprint, scope, id)
SELECT lpad(to_hex(x), 32, '0')::uuid, clock_timestamp() + 604800000 * interval '1 millisecond',
       '\x0102030405060708091011121314151617181920212223242526272829303132'::bytea, NULL, NULL
FROM (SELECT nextval('floor_seq') * 100 AS b) s, generate_series(s.b, s.b + 99) x;
\endpipeline
INSERT INTO floor_idem (id, payload)
SELECT lpad(to_hex(x), 32, '0')::uuid::text, '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea
FROM (SELECT nextval('floor_seq') * 100 AS b) s, generate_series(s.b, s.b + 99) x;
\startpipeline
INSERT INTO floor_offsets AS t (group_id, topic, partition, next_offset, updated_at)
VALUES ('g', 't', :client_id, nextval('floor_seq'), clock_timestamp())
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET next_offset = EXCLUDED.next_offset, updated_at = EXCLUDED.updated_at
    WHERE t.next_offset < EXCLUDED.next_offset;
COMMIT;
\endpipeline
