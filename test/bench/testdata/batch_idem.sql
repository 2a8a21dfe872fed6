-- What kafkapg.BatchAll with kafkapg.Offsets sends for a batch of 100
-- first deliveries: BEGIN; the keys claimed in one INSERT (pgtable's
-- ClaimBatchTx); the handler's one INSERT for the batch, as the baseline's;
-- the partition's position; COMMIT. The keys and fingerprints are
-- parameters on the Go path (digests computed by the client): here the keys
-- are random uuids and the fingerprint a constant, so that the server does
-- not hash for them.
\set k random(1, 4000000000000000000)
BEGIN;
INSERT INTO floor_claims AS e (key, expires_at, fingerprint, scope, id)
SELECT gen_random_uuid(), clock_timestamp() + 604800000 * interval '1 millisecond',
       '\x0102030405060708091011121314151617181920212223242526272829303132'::bytea, NULL, NULL
FROM generate_series(1, 100) g
ON CONFLICT (key) DO UPDATE
    SET expires_at = EXCLUDED.expires_at, fingerprint = EXCLUDED.fingerprint, token = NULL, result = NULL,
        scope = EXCLUDED.scope, id = EXCLUDED.id
    WHERE e.expires_at <= clock_timestamp()
RETURNING e.key;
INSERT INTO floor_idem (id, payload)
SELECT 'm-' || :k::text || '-' || g, '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea FROM generate_series(1, 100) g;
INSERT INTO floor_offsets AS t (group_id, topic, partition, next_offset, updated_at)
VALUES ('g', 't', :client_id, :k, clock_timestamp())
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET next_offset = EXCLUDED.next_offset, updated_at = EXCLUDED.updated_at
    WHERE t.next_offset < EXCLUDED.next_offset;
COMMIT;
