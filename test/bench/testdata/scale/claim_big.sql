-- The statements of a claim in pgtable (BEGIN and the insert of the key's row, ON CONFLICT DO NOTHING; COMMIT) on idem_scale.big; see setup.sql.
\set k random(1, 4000000000000000000)
\startpipeline
BEGIN;
INSERT INTO idem_scale.big (key, expires_at) VALUES (md5(:k::text)::uuid, clock_timestamp() + interval '1 day')
ON CONFLICT (key) DO NOTHING;
\endpipeline
COMMIT;
