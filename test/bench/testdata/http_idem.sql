-- What httpidem's transactional middleware sends for a first request
-- (pgtable's Process): BEGIN and the claim (the key's row, INSERT ... ON
-- CONFLICT DO NOTHING); the handler's INSERT ... RETURNING; the stored
-- response (about 200 bytes) added to the key's row, and COMMIT.
\set k random(1, 4000000000000000000)
\startpipeline
BEGIN;
INSERT INTO floor_claims (key, expires_at, fingerprint, scope, id)
VALUES (md5(:k::text)::uuid, clock_timestamp() + 86400000 * interval '1 millisecond', sha256(:k::text::bytea), NULL, NULL)
ON CONFLICT (key) DO NOTHING;
\endpipeline
INSERT INTO floor_payments_idem (amount, currency, customer) VALUES (4200, 'EUR', 'cus_' || :k::text) RETURNING id;
\startpipeline
UPDATE floor_claims SET result = convert_to(repeat('r', 200), 'UTF8') WHERE key = md5(:k::text)::uuid AND token IS NULL;
COMMIT;
\endpipeline
