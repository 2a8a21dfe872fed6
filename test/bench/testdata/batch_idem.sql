-- What kafkapg.BatchAll with kafkapg.Offsets sends for a batch of 100 first
-- deliveries, in the three round trips of the baseline: BEGIN and the keys'
-- claim (pgtable's BeginBatch: a plain INSERT of the sorted keys, no
-- conflict clause); the handler's one INSERT for the batch, as the
-- baseline's; the partition's position and COMMIT. On the Go path the keys
-- and fingerprints are parameters (digests computed by the client, keys
-- time-ordered with TimeOrderedKeys and UUIDv7 ids): here the keys are 100
-- numbers in a row from floor_seq and the fingerprint a constant, so that
-- the server does not hash for them.
\startpipeline
BEGIN;
INSERT INTO floor_claims (key, expires_at, fingerprint, scope, id)
SELECT lpad(to_hex(x), 32, '0')::uuid, clock_timestamp() + 604800000 * interval '1 millisecond',
       '\x0102030405060708091011121314151617181920212223242526272829303132'::bytea, NULL, NULL
FROM (SELECT nextval('floor_seq') * 100 AS b) s, generate_series(s.b, s.b + 99) x;
\endpipeline
INSERT INTO floor_idem_pk (id, payload)
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
