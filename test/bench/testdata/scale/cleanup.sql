-- One batch of pgtable's Cleanup on idem_scale.big; see setup.sql.
DELETE FROM idem_scale.big WHERE ctid = ANY (ARRAY(SELECT e.ctid FROM idem_scale.big e WHERE e.expires_at <= now() ORDER BY e.expires_at LIMIT 1000 FOR UPDATE SKIP LOCKED));
