-- Expires about 10% of idem_scale.big's rows, picked by the key's first byte; see setup.sql.
UPDATE idem_scale.big SET expires_at = now() - interval '1 hour' - (get_byte(uuid_send(key), 1) * interval '1 second') WHERE get_byte(uuid_send(key), 0) < 26;
VACUUM ANALYZE idem_scale.big;
