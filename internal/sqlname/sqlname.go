// Package sqlname validates and quotes the SQL identifiers idem takes from
// options (schema and table names). Names are checked against an allow-list
// before they are quoted; nothing a user passes is interpolated raw.
package sqlname

import (
	"fmt"
	"regexp"
	"strings"
)

var valid = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// Check returns an error naming option when name is not a lowercase SQL
// identifier of at most 63 bytes (letters, digits, underscore; not starting
// with a digit).
func Check(option, name string) error {
	if !valid.MatchString(name) {
		return fmt.Errorf("%s %q is not allowed: use 1 to 63 lowercase letters, digits and underscores, not starting with a digit", option, name)
	}
	return nil
}

// Quote returns name as a quoted identifier. Call Check first.
func Quote(name string) string {
	return `"` + strings.ReplaceAll(name, `"`, `""`) + `"`
}

// Qualified returns "schema"."name".
func Qualified(schema, name string) string { return Quote(schema) + "." + Quote(name) }

// SchemaTable fills in the defaults of a schema and table pair taken from
// options ("public" and defTable) and checks both. option names the options
// in errors, e.g. "pgtable: Options". maxTable, when positive, bounds the
// table name so the names derived from it (indexes, partitions,
// <table>_migrations) stay within PostgreSQL's 63 bytes.
func SchemaTable(option string, schema, table *string, defTable string, maxTable int) error {
	if *schema == "" {
		*schema = "public"
	}
	if *table == "" {
		*table = defTable
	}
	if err := Check(option+".Schema", *schema); err != nil {
		return err
	}
	if err := Check(option+".Table", *table); err != nil {
		return err
	}
	if maxTable > 0 && len(*table) > maxTable {
		return fmt.Errorf("%s.Table %q is longer than %d bytes; the names of its indexes and migrations table are derived from it", option, *table, maxTable)
	}
	return nil
}
