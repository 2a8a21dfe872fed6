-- What sqltable's Process sends on PostgreSQL through database/sql (pgx's
-- stdlib driver) for a first delivery whose handler makes one INSERT and
-- returns no result, four round trips: BEGIN; the claim (the key's row:
-- its 16-byte digest, INSERT ... ON CONFLICT DO NOTHING); the handler's
-- INSERT; COMMIT. The digest here is md5 of the key, 16 bytes like
-- sqltable's; the fingerprint is 32 bytes.
\set k random(1, 4000000000000000000)
BEGIN;
INSERT INTO floor_sqlclaims (digest, expires_at, fingerprint, scope, id)
VALUES (decode(md5(:k::text), 'hex'), (clock_timestamp() + CAST(604800000 AS bigint) * interval '1 millisecond'), sha256(:k::text::bytea), NULL, NULL) ON CONFLICT (digest) DO NOTHING;
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text, '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
COMMIT;
