-- idem: a table made in the first layout (primary key (scope, id), a state
-- column, lease_until, created_at and completed_at) is converted in place,
-- keeping its rows, its grants and its name: key becomes the primary key,
-- filled with the digest of scope and id; an in-flight row keeps its token
-- and its lease's end in expires_at; a done row has no token. scope and id
-- are kept only with Options.KeepKeys. The table is rewritten once, under
-- an ACCESS EXCLUSIVE lock held until the migration commits. The rows of its
-- partitions keep the dropped columns' bits in their null bitmap (8 bytes a
-- row more than in this layout); partitions made afterwards are made in
-- this layout.
DO $$
DECLARE
    pk name;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = '{{.Table}}'::regclass AND attname = 'state' AND NOT attisdropped) THEN
        RETURN; -- made in this layout
    END IF;
    -- The conversion locks the table: it waits at most 5 s for the lock (a
    -- long transaction on the table would otherwise queue every claim
    -- behind it), then fails with a lock timeout; run the migration again.
    PERFORM set_config('lock_timeout', '5s', true);
    SELECT conname INTO pk FROM pg_constraint WHERE conrelid = '{{.Table}}'::regclass AND contype = 'p';
    -- Every writer of the first layout kept these already: a done row has
    -- no token, an in-flight row's lease ends at expires_at.
    UPDATE {{.Table}} SET token = CASE WHEN state = 1 THEN token END,
                          expires_at = CASE WHEN state = 1 THEN lease_until ELSE expires_at END
    WHERE (state = 2 AND token IS NOT NULL) OR (state = 1 AND expires_at IS DISTINCT FROM lease_until);
    ALTER TABLE {{.Table}} ADD COLUMN key uuid;
    -- One rewrite of every row.
    EXECUTE format($f$
        ALTER TABLE {{.Table}}
            DROP CONSTRAINT %I,
            DROP COLUMN state, DROP COLUMN lease_until, DROP COLUMN created_at, DROP COLUMN completed_at,
            ALTER COLUMN scope DROP NOT NULL,
            ALTER COLUMN id DROP NOT NULL,
            ALTER COLUMN key TYPE uuid USING {{.Key "scope" "id"}},
            ALTER COLUMN scope TYPE text USING {{if .KeepKeys}}scope{{else}}NULL{{end}},
            ALTER COLUMN id TYPE text USING {{if .KeepKeys}}id{{else}}NULL{{end}},
            ADD PRIMARY KEY (key, {{.PartColumn}})
        $f$, pk);
END
$$;
