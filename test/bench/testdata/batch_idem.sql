-- What kafkapg.Batch with kafkapg.Offsets sends for a batch of 100 first
-- deliveries: BEGIN; the keys claimed in one INSERT (pgtable's
-- ClaimBatchTx); the handler's INSERT once per record; the partition's
-- position; COMMIT.
\set k random(1, 4000000000000000000)
BEGIN;
INSERT INTO floor_claims AS e (key, expires_at, fingerprint, scope, id)
SELECT md5(:k::text || '-' || g)::uuid, clock_timestamp() + 604800000 * interval '1 millisecond', sha256((:k::text || '-' || g)::bytea), NULL, NULL
FROM generate_series(1, 100) g ORDER BY 1
ON CONFLICT (key) DO UPDATE
    SET expires_at = EXCLUDED.expires_at, fingerprint = EXCLUDED.fingerprint, token = NULL, result = NULL,
        scope = EXCLUDED.scope, id = EXCLUDED.id
    WHERE e.expires_at <= clock_timestamp()
RETURNING e.key;
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-1', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-2', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-3', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-4', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-5', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-6', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-7', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-8', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-9', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-10', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-11', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-12', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-13', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-14', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-15', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-16', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-17', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-18', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-19', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-20', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-21', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-22', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-23', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-24', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-25', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-26', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-27', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-28', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-29', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-30', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-31', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-32', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-33', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-34', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-35', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-36', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-37', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-38', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-39', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-40', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-41', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-42', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-43', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-44', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-45', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-46', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-47', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-48', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-49', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-50', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-51', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-52', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-53', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-54', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-55', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-56', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-57', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-58', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-59', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-60', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-61', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-62', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-63', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-64', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-65', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-66', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-67', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-68', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-69', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-70', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-71', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-72', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-73', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-74', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-75', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-76', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-77', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-78', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-79', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-80', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-81', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-82', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-83', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-84', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-85', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-86', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-87', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-88', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-89', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-90', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-91', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-92', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-93', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-94', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-95', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-96', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-97', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-98', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-99', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_idem (id, payload) VALUES ('m-' || :k::text || '-100', '{"order":"A-1","amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}'::bytea);
INSERT INTO floor_offsets AS t (group_id, topic, partition, next_offset, updated_at)
VALUES ('g', 't', :client_id, :k, clock_timestamp())
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET next_offset = EXCLUDED.next_offset, updated_at = EXCLUDED.updated_at
    WHERE t.next_offset < EXCLUDED.next_offset;
COMMIT;
