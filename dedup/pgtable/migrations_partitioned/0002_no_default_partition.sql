-- idem: a partitioned table has no default partition, so that old
-- partitions can be detached concurrently. A default partition made by an
-- earlier layout of the table is detached (this takes an ACCESS EXCLUSIVE
-- lock on the table until the migration commits); its expired rows are
-- deleted and its live rows move to partitions of their own days.
{{- if eq .PartType "date"}}
DO $$
DECLARE
    day date;
BEGIN
    IF to_regclass('{{.Partition "default"}}') IS NULL THEN
        RETURN;
    END IF;
    ALTER TABLE {{.Table}} DETACH PARTITION {{.Partition "default"}};
    DELETE FROM {{.Partition "default"}} WHERE expires_at <= clock_timestamp();
    FOR day IN SELECT DISTINCT part_day FROM {{.Partition "default"}} LOOP
        EXECUTE format('CREATE TABLE %I.%I (LIKE %s INCLUDING ALL)',
            '{{.Schema}}', '{{.TableName}}_p' || to_char(day, 'YYYYMMDD'), '{{.Table}}');
        EXECUTE format('ALTER TABLE %s ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
            '{{.Table}}', '{{.Schema}}', '{{.TableName}}_p' || to_char(day, 'YYYYMMDD'), day, day + 1);
    END LOOP;
    INSERT INTO {{.Table}} SELECT * FROM {{.Partition "default"}};
    DROP TABLE {{.Partition "default"}};
END
$$;
{{- else}}
SELECT 1; -- tables partitioned by hour never had a default partition
{{- end}}
