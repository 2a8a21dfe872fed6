-- idem: processed_events keyed by (scope, id). Every time in it comes from the
-- database clock. state 1 = in flight (lease mode), 2 = done.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    scope        text        NOT NULL,
    id           text        NOT NULL,
    fingerprint  bytea,
    state        smallint    NOT NULL,
    token        text,
    lease_until  timestamptz,
    result       bytea,
    created_at   timestamptz NOT NULL,
    completed_at timestamptz,
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (scope, id),
    CHECK (state IN (1, 2))
);
CREATE INDEX IF NOT EXISTS {{.Index "expires_at"}} ON {{.Table}} (expires_at);
